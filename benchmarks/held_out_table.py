"""What a drafter keeps on each held-out set, in-distribution and not, teacher-forced along
the target's own greedy answers: depth-1 top-1 and the accepted length of a chain of every
depth, per shard folder and per source (the answers' category) inside it.

    python benchmarks/held_out_table.py vllm_mtpspec/shipped_heads/smollm2-135m-instruct \
        "ShareGPT first turns, as split before=runs/shards/held-out" \
        "ShareGPT first turns, audited=runs/shards/held-out-audited" ... \
        --json benchmarks/results/held_out_block_v2.json --markdown benchmarks/results/held_out_block_v2.md
"""
import argparse
import json
from pathlib import Path

from vllm_mtpspec.bench.stamp import describe, stamp
from vllm_mtpspec.checkpoint import load_heads
from vllm_mtpspec.models import resolve_model
from vllm_mtpspec.shards import list_shards
from vllm_mtpspec.weights import embedding_and_lm_head
from vllm_mtpspec_train.evaluate import evaluate_heads


def row(label: str, scores: dict) -> str:
    return (f"| {label} | {scores['rows']:,} | {scores['top1'][0]:.3f} | "
            f"{scores['mean_accepted_len']['chain']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heads", help="a heads directory")
    parser.add_argument("sets", nargs="+", help="LABEL=SHARD_FOLDER, one per held-out set")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    embed, lm_head = embedding_and_lm_head(resolve_model(args.model, dtype="fp32"))
    heads = load_heads(args.heads)
    results, lines = {}, []
    depth = heads.config.num_heads
    header = f"| held-out set / source | positions | depth-1 top-1 | chain of {depth}, accepted |\n|---|---|---|---|"
    for spec in args.sets:
        label, _, folder = spec.partition("=")
        scores = evaluate_heads(heads, list_shards(folder), lm_head=lm_head, embed=embed, max_tree_nodes=16)
        results[label] = {"folder": folder, **{k: v for k, v in scores.items() if k != "rank_accuracy"}}
        lines.append(row(f"**{label}**", scores))
        categories = scores.get("per_category", {})
        if len(categories) > 1:
            lines += [row(f"&nbsp;&nbsp;{name}", s) for name, s in sorted(categories.items())]
    run = stamp()
    table = f"{args.heads}; {describe(run)}\n\n`{run['command']}`\n\n{header}\n" + "\n".join(lines)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"stamp": run, "heads": args.heads, "sets": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
