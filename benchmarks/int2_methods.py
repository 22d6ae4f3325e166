"""INT2 quantizers side by side on the same heads and the same held-out answers.

    python benchmarks/int2_methods.py vllm_mtpspec/shipped_heads/smollm2-135m-instruct \
        --held-out runs/sharegpt-sd/held-out --calibration runs/sharegpt-sd/train \
        --methods rtn,search,gptq --group-sizes 64 --out benchmarks/results/int2_methods

Calibration rows come from training shards (never the held-out ones); `qat` starts from
GPTQ and trains on all the calibration shards' rows (vllm_mtpspec_train/quantize_aware.py). For every method:
per-head top-1, chain and consensus accepted length (the training job's evaluation,
vllm_mtpspec_train/evaluate.py), bytes and bits per weight; written as JSON and a Markdown table.
"""
import argparse
import json
import time
from pathlib import Path

from vllm_mtpspec.calibration_data import heads_statistics_from_shards
from vllm_mtpspec.checkpoint import load_heads, save_heads
from vllm_mtpspec.cli import heads_summary
from vllm_mtpspec.heads_quant import quantize_heads
from vllm_mtpspec.models import resolve_model
from vllm_mtpspec.shards import list_shards
from vllm_mtpspec.weights import embedding_and_lm_head
from vllm_mtpspec_train.evaluate import evaluate_heads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heads")
    parser.add_argument("--held-out", required=True, help="shards to score on")
    parser.add_argument("--calibration", required=True, help="training shards for the calibrated methods")
    parser.add_argument("--calibration-rows", type=int, default=32768)
    parser.add_argument("--methods", default="rtn,search,gptq", help="from rtn, search, gptq, qat")
    parser.add_argument("--qat-steps", type=int, default=300, help="qat: fake-quantized training steps after GPTQ")
    parser.add_argument("--qat-lr", type=float, default=1e-5)
    parser.add_argument("--group-sizes", default="64")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", required=True, help="path prefix for .json and .md")
    parser.add_argument("--save-dir", default="runs/int2", help="where each quantized heads directory is written")
    args = parser.parse_args()
    embed, lm_head = embedding_and_lm_head(resolve_model(args.model, dtype="fp32"))
    held_out = list_shards(args.held_out)
    heads = load_heads(args.heads)
    rows = []

    def score(name, candidate, seconds, directory):
        started = time.perf_counter()
        scores = evaluate_heads(candidate, held_out, lm_head=lm_head, embed=embed)
        size = heads_summary(directory)
        rows.append({"heads": name, "top1": scores["top1"], "chain": scores["mean_accepted_len"]["chain"],
                     "consensus": scores["mean_accepted_len"]["consensus"], "bytes": size["bytes_on_disk"],
                     "bits_per_weight": size["bits_per_weight"], "quantize_seconds": round(seconds, 1),
                     "rows": scores["rows"]})
        print(json.dumps(rows[-1]), f"(scored in {time.perf_counter() - started:.0f} s)", flush=True)

    score("fp (the stored weights, run in fp32)", heads, 0.0, args.heads)
    started = time.perf_counter()
    statistics, described = heads_statistics_from_shards(heads, args.calibration, model=args.model,
                                                         max_rows=args.calibration_rows)
    print(f"calibration: {described} in {time.perf_counter() - started:.0f} s", flush=True)
    for group_size in [int(g) for g in args.group_sizes.split(",")]:
        for method in args.methods.split(","):
            started = time.perf_counter()
            if method == "qat":
                from vllm_mtpspec_train.examples import load_examples
                from vllm_mtpspec_train.quantize_aware import quantize_aware

                examples = load_examples(list_shards(args.calibration), heads.num_heads)
                quantized = quantize_aware(heads, examples, lm_head=lm_head, embed=embed, steps=args.qat_steps,
                                           lr=args.qat_lr, group_size=group_size, statistics=statistics)
            else:
                quantized = quantize_heads(heads, method=method, group_size=group_size,
                                           statistics=None if method == "rtn" else statistics, calibration=described)
            seconds = time.perf_counter() - started
            directory = save_heads(quantized, Path(args.save_dir) / f"int2-{method}-g{group_size}")
            score(f"int2 {method}, group {group_size}", quantized, seconds, directory)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"heads": args.heads, "held_out": args.held_out,
                                                    "calibration": described, "rows": rows}, indent=1) + "\n")
    lines = ["| heads | top-1 per head | chain | consensus | bytes | bits/weight |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        top1 = " / ".join(f"{v:.3f}".lstrip("0") for v in r["top1"])
        lines.append(f"| {r['heads']} | {top1} | {r['chain']:.3f} | {r['consensus']:.3f} | {r['bytes']:,} | "
                     f"{r['bits_per_weight']} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
