"""What the draft planner predicted against what each step then took, step by step.

Runs one engine with mtpspec's default settings in this process, decodes the bench's
held-out prompts at one batch size, and records for every planned step: the running
requests, the draft tokens the planner sent, the step time and the tokens it predicted
(its cost curve and kept chances as corrected by its plan check; drafting left out; the
curve's own figure too), the time the step really took and the tokens it emitted, and
the steps where the proposal rested. The summary compares steps that drafted with steps
that did not (their measured tokens per second is what the planner's choice is worth),
and what the drafts sent kept and added to their steps against what was predicted.

    python benchmarks/planner_trace.py --batch-size 32 --temperature 0 --rounds 3 --pace-cohorts never \
        --json benchmarks/results/planner_trace_xeon_32.json --plot benchmarks/results/planner_trace_xeon_32.png
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def install_recorder(events: list[dict]) -> None:
    """Wraps the planner's methods so that every observation and plan is recorded."""
    from vllm_mtpspec.draft_planner import DraftPlanner

    observe, plan, wants = DraftPlanner.observe_step, DraftPlanner.plan, DraftPlanner.wants_proposal

    def observe_step(self, req_ids, emitted, verified_drafts, sampled, *, timed):
        started = self._verify_started
        if events and events[-1].get("seconds") is None and started is not None:
            events[-1].update(seconds=self.clock() - started, emitted=int(sum(emitted)), timed=timed,
                              verified=int(sum(verified_drafts)) if verified_drafts is not None else 0)
        return observe(self, req_ids, emitted, verified_drafts, sampled, timed=timed)

    def planned(self, req_ids, candidates, *, sampled, drafting_seconds=0.0):
        lengths = plan(self, req_ids, candidates, sampled=sampled, drafting_seconds=drafting_seconds)
        curve = self.costs.curve(len(req_ids), sampled)
        draft_tokens = int(sum(lengths))
        events.append(dict(kind="planned", batch=len(req_ids), sampled=sampled, offered=sum(c is not None for c in candidates),
                           draft_tokens=draft_tokens, predicted=self.last.seconds,
                           predicted_by_curve=curve.seconds(len(req_ids) + draft_tokens),
                           predicted_without=curve.seconds(len(req_ids)), expected=self.last.expected_tokens,
                           rate=self.last.tokens_per_second, explored=self.last.explored,
                           drafting=drafting_seconds, seconds=None))
        return lengths

    def wants_proposal(self, batch_size, sampled):
        proposing = wants(self, batch_size, sampled)
        if not proposing:
            events.append(dict(kind="rested", batch=batch_size, sampled=sampled, draft_tokens=0, seconds=None))
        return proposing

    DraftPlanner.observe_step, DraftPlanner.plan, DraftPlanner.wants_proposal = observe_step, planned, wants_proposal


def _ratio_of_sums(real: list[float], predicted: list[float]) -> float | None:
    return sum(real) / sum(predicted) if predicted and sum(predicted) > 0 else None


def summarize(events: list[dict]) -> dict:
    timed = [e for e in events if e.get("seconds") is not None and e.get("timed")]
    drafted = [e for e in timed if e["draft_tokens"]]
    plain = [e for e in timed if not e["draft_tokens"]]

    def rate(steps):
        seconds = sum(e["seconds"] for e in steps)
        return sum(e["emitted"] for e in steps) / seconds if seconds else None

    errors = [e["seconds"] / e["predicted"] for e in drafted if e.get("predicted")]
    checked = [e for e in drafted if e.get("predicted") and e.get("predicted_without") is not None]
    return dict(steps=len(timed), drafted_steps=len(drafted), rested_steps=sum(e["kind"] == "rested" for e in timed),
                tokens_per_s_drafted=rate(drafted), tokens_per_s_not_drafted=rate(plain),
                draft_tokens_per_request=statistics.fmean(e["draft_tokens"] / e["batch"] for e in drafted) if drafted else 0,
                emitted_per_request_drafted=statistics.fmean(e["emitted"] / e["batch"] for e in drafted) if drafted else None,
                expected_per_request_drafted=statistics.fmean(e["expected"] / e["batch"] for e in drafted) if drafted else None,
                actual_over_predicted_seconds=statistics.median(errors) if errors else None,
                kept_over_predicted=_ratio_of_sums([e["emitted"] - e["batch"] for e in checked],
                                                   [e["expected"] - e["batch"] for e in checked]),
                added_seconds_over_predicted=_ratio_of_sums([e["seconds"] - e["predicted_without"] for e in checked],
                                                            [e["predicted"] - e["predicted_without"] for e in checked]),
                drafting_seconds_per_drafted_step=statistics.fmean(e["drafting"] for e in drafted) if drafted else None)


def generates(events: list[dict]) -> list[list[dict]]:
    """The events split per generate call: a batch only shrinks within one."""
    out: list[list[dict]] = []
    for e in events:
        if not out or e["batch"] > out[-1][-1]["batch"]:
            out.append([])
        out[-1].append(e)
    return out


def plot(runs: dict[str, list[dict]], path: Path, title: str) -> None:
    """Left: running requests against the time into each generate (the tail where the batch
    has drifted apart). Right: step time against query tokens, measured and predicted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = iter(["tab:red", "tab:blue", "tab:green", "tab:purple"])
    for label, events in runs.items():
        colour = next(colours)
        for n, steps in enumerate(generates(events)):
            clock, xs, ys = 0.0, [], []
            for e in steps:
                xs.append(clock)
                ys.append(e["batch"])
                clock += e.get("seconds") or 0.0
            left.step(xs, ys, where="post", color=colour, alpha=0.6, label=label if n == 0 else None)
        timed = [e for e in events if e.get("seconds") is not None and e.get("timed")]
        right.scatter([e["batch"] + e["draft_tokens"] for e in timed], [1e3 * e["seconds"] for e in timed], s=8,
                      c=colour, alpha=0.4, label=f"{label}: measured")
        predicted = [e for e in timed if e.get("predicted")]
        right.scatter([e["batch"] + e["draft_tokens"] for e in predicted], [1e3 * e["predicted"] for e in predicted],
                      s=12, marker="x", c=colour, alpha=0.6, label=f"{label}: predicted")
    left.set_xlabel("seconds into the generate (verify steps only)")
    left.set_ylabel("running requests")
    left.legend(fontsize=8)
    right.set_xlabel("query tokens in the step (requests + draft tokens)")
    right.set_ylabel("step time (ms), drafting left out")
    right.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--speculation", default="on", choices=("on", "off"),
                        help="off: vLLM alone on the same batches (its generate times only)")
    parser.add_argument("--pace-cohorts", default="sampled", choices=("never", "sampled", "always"))
    parser.add_argument("--json", required=True, help="where to write the trace (with --plot-only: traces to draw, "
                                                      "comma-separated)")
    parser.add_argument("--plot-only", action="store_true", help="draw --plot from the traces in --json, run nothing")
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    if args.plot_only:
        traces = [json.loads(Path(p).read_text()) for p in args.json.split(",")]
        plot({f"pace_cohorts={t['pace_cohorts']}": t["events"] for t in traces}, Path(args.plot),
             f"planner at batch {traces[0]['batch_size']}, T={traces[0]['temperature']}, {traces[0]['machine']}")
        return
    from vllm import SamplingParams

    from vllm_mtpspec.bench.in_process import in_process_engine
    from vllm_mtpspec.bench.stamp import stamp
    from vllm_mtpspec.shipped import shipped_heads_dir

    events: list[dict] = []
    install_recorder(events)
    speculative = {"method": "mtpspec", "model": str(shipped_heads_dir()), "num_speculative_tokens": 3,
                   "pace_cohorts": args.pace_cohorts}
    # In this process: the planner it records lives here.
    llm, batches = in_process_engine(args.batch_size, num_prompts=args.num_prompts,
                                     max_new_tokens=args.max_new_tokens, dtype=args.dtype,
                                     speculative_config=speculative if args.speculation == "on" else None)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_new_tokens, ignore_eos=True)
    rounds = []
    for r in range(args.rounds):
        for texts in batches:
            first = len(events)
            started = time.perf_counter()
            outputs = llm.generate(texts, params, use_tqdm=False)
            seconds = time.perf_counter() - started
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            rounds.append(dict(round=r, seconds=seconds, tokens=tokens, **summarize(events[first:])))
            print(json.dumps(rounds[-1]))
    run_stamp = stamp()
    result = dict(machine=f"{run_stamp['cpu']['model']}, {run_stamp['cpu']['count']} CPUs", stamp=run_stamp,
                  batch_size=args.batch_size, temperature=args.temperature, dtype=args.dtype, speculation=args.speculation,
                  pace_cohorts=args.pace_cohorts, rounds=rounds, all=summarize(events), events=events)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["all"], indent=1))
    if args.plot and events:
        plot({f"pace_cohorts={args.pace_cohorts}": events}, Path(args.plot),
             f"planner at batch {args.batch_size}, T={args.temperature}, {result['machine']}")


if __name__ == "__main__":
    main()
