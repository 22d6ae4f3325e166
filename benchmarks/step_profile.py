"""Where a step's time goes: vLLM alone against mtpspec, from cProfile.

Each configuration decodes the bench's held-out prompts in an engine in its own process
(bench/in_process.py: the engine core, the model runner and the proposer run under the
profiler), after one warm-up batch. The configurations take turns, round
by round, so that a slower stretch of a shared machine falls on all of them. Reported per
engine step (the profile's time divided by its engine steps): the model's forward pass,
the target's LM head, the sampler (vLLM's rejection sampler where drafts were sent), the
proposal (mtpspec's heads, prompt lookup and planner; ngram's search), the rest of the
step, and the functions whose own time per step differs most between the first
configuration and each other one, with their calls per step. cProfile slows Python code,
not the native matrix products: read the Python buckets as upper bounds.

    python benchmarks/step_profile.py --configs none,mtpspec-k1,mtpspec-k3,ngram-k3 --batch-size 1 \\
        --num-prompts 8 --rounds 2 --json benchmarks/results/step_profile_batch1_avx2.json

With --no-profile the configurations are only timed, each round's tokens/s as a ratio to the
first configuration's; idle-kN (the default engine, never proposing) then says what carrying
speculation costs where nothing is sent:

    python benchmarks/step_profile.py --configs none,idle-k3,default-k3 --batch-size 4 --temperature 0.7 \\
        --rounds 4 --no-profile --json benchmarks/results/step_timing_idle_batch4_t07_avx2.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# Buckets of a step, by the function whose cumulative time is the bucket's (vLLM 0.32/0.33).
BUCKETS = {
    "engine step": ("vllm/v1/engine/core.py", "step"),
    "model forward": ("vllm/v1/worker/gpu_model_runner.py", "_model_forward"),
    # The target's LM head (heads without a draft vocabulary project through it too, inside
    # the proposal: their time then counts in both).
    "logits": ("vllm/model_executor/layers/logits_processor.py", "forward"),
    "sampling": ("vllm/v1/worker/gpu_model_runner.py", "_sample"),
    "proposal": ("vllm/v1/worker/gpu_model_runner.py", "propose_draft_token_ids"),
    "input preparation": ("vllm/v1/worker/gpu_model_runner.py", "_prepare_inputs"),
    "scheduler": ("vllm/v1/core/sched/scheduler.py", "schedule"),
}


CONFIG_NAMES = "none, ngram-kN, mtpspec-kN, default-kN or idle-kN (N draft tokens)"


def speculative_config(name: str) -> dict | None:
    """none | ngram-kN | mtpspec-kN (the shipped heads alone, prompt lookup off) | default-kN
    (heads and prompt lookup): the configs of `mtpspec bench`'s own rows of those names;
    idle-kN: default-kN's engine with a proposer that never proposes (see _never_propose)."""
    if name == "none":
        return None
    family, _, k = name.rpartition("-k")
    if not k.isdigit() or family not in ("ngram", "mtpspec", "default", "idle"):
        raise SystemExit(f"--configs: {name!r}: give {CONFIG_NAMES}")
    from vllm_mtpspec.bench.methods import build_methods
    from vllm_mtpspec.shipped import shipped_heads_dir

    method, = build_methods(["ngram" if family == "ngram" else "mtpspec-chain"], model_dir="",
                            heads_dirs=[str(shipped_heads_dir())], num_heads=[int(k)], quants=["fp"], tree="chain",
                            work_dir=Path(tempfile.gettempdir()), num_spec_tokens=int(k),
                            lookups=[family in ("default", "idle")])
    return method.speculative_config


def _never_propose() -> None:
    """idle-kN: what speculation costs where it sends nothing. vLLM still runs its
    speculative paths and mtpspec's runner hooks still capture every step's states; only
    the proposal itself (lookup, heads, planner) is skipped."""
    from vllm_mtpspec.vllm.proposer import MTPSpecProposer

    MTPSpecProposer.propose = lambda self, sampled_token_ids, *args, **kwargs: [[] for _ in sampled_token_ids]


def profile_one(config: str, batch_size: int, num_prompts: int, max_new_tokens: int, temperature: float,
                out: Path, profile: bool = True) -> None:
    """Runs in a child process: one engine, its decode profiled (unless not profile), the
    stats dumped to out."""
    import cProfile
    import time

    from vllm import SamplingParams

    from vllm_mtpspec.bench.in_process import in_process_engine

    if config.startswith("idle-"):
        _never_propose()
    llm, groups = in_process_engine(batch_size, num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                                    speculative_config=speculative_config(config))
    params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens, ignore_eos=True)
    llm.generate(groups[0], params, use_tqdm=False)  # warm-up
    profiler = cProfile.Profile()
    started, tokens = time.perf_counter(), 0
    if profile:
        profiler.enable()
    for group in groups:
        tokens += sum(len(o.outputs[0].token_ids) for o in llm.generate(group, params, use_tqdm=False))
    profiler.disable()
    seconds = time.perf_counter() - started
    if profile:
        profiler.dump_stats(str(out))
    out.with_suffix(".json").write_text(json.dumps(dict(tokens=tokens, seconds=seconds)))


def _short(filename: str) -> str:
    """A source file's name from its package on (vllm/..., torch/..., vllm_mtpspec/...)."""
    for marker in ("site-packages/", "/vllm_mtpspec/", "/benchmarks/"):
        if marker in filename:
            tail = filename.split(marker, 1)[1]
            return tail if marker == "site-packages/" else marker.strip("/") + "/" + tail
    return filename


def per_step(stats_path: Path) -> dict:
    """The profile as per-step figures: buckets (ms), and every function's own ms and calls."""
    import pstats

    stats = pstats.Stats(str(stats_path)).stats
    by_name = {}
    for (filename, line, function), (_, calls, own, cumulative, _) in stats.items():
        key = f"{_short(filename)}:{line}({function})"
        by_name[key] = (filename, function, calls, own, cumulative)
    steps = next((calls for filename, function, calls, _, _ in by_name.values()
                  if filename.endswith(BUCKETS["engine step"][0]) and function == BUCKETS["engine step"][1]), 0)
    if not steps:
        raise SystemExit(f"{stats_path}: no engine steps in the profile (vLLM's EngineCore.step was not called)")
    buckets = {}
    for bucket, (suffix, function) in BUCKETS.items():
        # The outermost of same-named functions (vLLM's runner has two propose_draft_token_ids).
        buckets[bucket] = 1e3 * max((cumulative for filename, name, _, _, cumulative in by_name.values()
                                     if filename.endswith(suffix) and name == function), default=0.0) / steps
    buckets["rest of the step"] = buckets["engine step"] - sum(v for k, v in buckets.items() if k != "engine step")
    functions = {key: (1e3 * own / steps, calls / steps) for key, (_, _, calls, own, _) in by_name.items()}
    return dict(steps=steps, buckets=buckets, functions=functions)


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per configuration, the median over its rounds of every per-step figure."""
    summary = {}
    for config, rounds in runs.items():
        buckets = {b: statistics.median(run["buckets"][b] for run in rounds) for b in rounds[0]["buckets"]}
        names = set().union(*(run["functions"] for run in rounds))
        functions = {n: tuple(statistics.median(run["functions"].get(n, (0.0, 0.0))[i] for run in rounds)
                              for i in (0, 1)) for n in names}
        summary[config] = dict(tokens_per_s=statistics.median(run["tokens"] / run["seconds"] for run in rounds),
                               steps=statistics.median(run["steps"] for run in rounds),
                               buckets_ms_per_step=buckets, functions=functions)
    return summary


def largest_increases(summary: dict[str, dict], configs: list[str], top: int) -> dict[str, list[dict]]:
    """For each configuration after the first, the functions whose own time per step grew most
    against the first's, with their calls per step."""
    base = summary[configs[0]]["functions"]
    comparisons = {}
    for config in configs[1:]:
        mine = summary[config]["functions"]
        deltas = sorted(((mine.get(n, (0, 0))[0] - base.get(n, (0, 0))[0], n) for n in set(mine) | set(base)),
                        reverse=True)[:top]
        comparisons[config] = [dict(function=n, own_ms_delta=d, own_ms=mine.get(n, (0, 0))[0],
                                    own_ms_base=base.get(n, (0, 0))[0], calls=mine.get(n, (0, 0))[1],
                                    calls_base=base.get(n, (0, 0))[1]) for d, n in deltas]
    return comparisons


def print_report(summary: dict[str, dict], comparisons: dict[str, list[dict]], configs: list[str], title: str) -> None:
    print(f"\nms per engine step ({title}):")
    print("| bucket | " + " | ".join(configs) + " |\n|---|" + "---|" * len(configs))
    for bucket in summary[configs[0]]["buckets_ms_per_step"]:
        print(f"| {bucket} | " + " | ".join(f"{summary[c]['buckets_ms_per_step'][bucket]:.2f}" for c in configs) + " |")
    print("| tokens/s | " + " | ".join(f"{summary[c]['tokens_per_s']:.1f}" for c in configs) + " |")
    for config, rows in comparisons.items():
        print(f"\nown time per step, {config} against {configs[0]} (largest increases):")
        for row in rows:
            print(f"  {row['own_ms_delta']:+.3f} ms ({row['own_ms_base']:.3f} -> {row['own_ms']:.3f}; calls "
                  f"{row['calls_base']:.1f} -> {row['calls']:.1f})  {row['function']}")


def report_timings(runs: dict[str, list[dict]], configs: list[str], json_path: Path, header: dict) -> None:
    """--no-profile: tokens/s per configuration and round, and each round's ratio to the
    first configuration's in the same round (the rounds take turns, so a ratio compares
    engines that ran minutes apart at most)."""
    rates = {c: [run["tokens"] / run["seconds"] for run in runs[c]] for c in configs}
    ratios = {c: [mine / base for mine, base in zip(rates[c], rates[configs[0]])] for c in configs}
    print(f"\ntokens/s and ratio to {configs[0]}, per round:")
    for c in configs:
        print(f"  {c}: " + ", ".join(f"{rate:.1f} ({ratio:.3f}x)" for rate, ratio in zip(rates[c], ratios[c]))
              + f"; median ratio {statistics.median(ratios[c]):.3f}x")
    json_path.write_text(json.dumps(dict(**header, configs=configs, tokens_per_s=rates, ratios=ratios,
                                         median_ratio={c: statistics.median(ratios[c]) for c in configs}), indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="none,mtpspec-k1,mtpspec-k3",
                        help="comma-separated: none, ngram-kN, mtpspec-kN (heads alone), default-kN, idle-kN "
                             "(default-kN's engine, never proposing); the first is the one the others are "
                             "compared with")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="every request's (ignore_eos: all make "
                        "--max-new-tokens tokens)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--top", type=int, default=12, help="functions listed per comparison")
    parser.add_argument("--no-profile", action="store_true", help="time the configurations without the "
                        "profiler (which slows Python code): report each one's tokens/s and its ratio to the first's, "
                        "per round")
    parser.add_argument("--json", required=True)
    parser.add_argument("--child", nargs=2, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        profile_one(args.child[0], args.batch_size, args.num_prompts, args.max_new_tokens, args.temperature,
                    Path(args.child[1]), profile=not args.no_profile)
        return
    configs = args.configs.split(",")
    for config in configs:
        speculative_config(config)  # refuse a bad name before any engine starts
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as folder:
        for r in range(args.rounds):
            for config in configs:
                out = Path(folder) / f"{config}_{r}.prof"
                subprocess.run([sys.executable, __file__, "--child", config, str(out), "--batch-size",
                                str(args.batch_size), "--num-prompts", str(args.num_prompts), "--max-new-tokens",
                                str(args.max_new_tokens), "--temperature", str(args.temperature), "--json", args.json]
                               + (["--no-profile"] if args.no_profile else []),
                               check=True, stdout=subprocess.DEVNULL)
                timing = json.loads(out.with_suffix(".json").read_text())
                runs[config].append(timing if args.no_profile else dict(per_step(out), **timing))
                print(f"round {r + 1}, {config}: {timing['tokens'] / timing['seconds']:.1f} tokens/s"
                      + ("" if args.no_profile else f", {runs[config][-1]['steps']} steps"), flush=True)
    from vllm_mtpspec.bench.stamp import stamp

    run_stamp = stamp()
    machine = dict(machine=f"{run_stamp['cpu']['model']}, {run_stamp['cpu']['count']} CPUs", stamp=run_stamp)
    if args.no_profile:
        report_timings(runs, configs, Path(args.json), dict(**machine, batch_size=args.batch_size,
                                                           temperature=args.temperature, rounds=args.rounds))
        return
    summary = summarize(runs)
    comparisons = largest_increases(summary, configs, args.top)
    print_report(summary, comparisons, configs, f"median of {args.rounds} rounds, batch {args.batch_size}, "
                 f"T={args.temperature}")
    for entry in summary.values():  # only what the tables read: the full profiles are large
        entry.pop("functions")
    Path(args.json).write_text(json.dumps(dict(**machine, batch_size=args.batch_size, temperature=args.temperature,
                                               rounds=args.rounds, configs=configs, summary=summary,
                                               largest_increases=comparisons), indent=1))


if __name__ == "__main__":
    main()
