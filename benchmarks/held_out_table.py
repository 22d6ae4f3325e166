"""What drafters keep on each held-out set, in-distribution and not, teacher-forced along
the target's own greedy answers: depth-1 top-1 and the accepted length of a chain of every
depth, per shard folder and per source (the answers' category) inside it. Several drafters
(--compare) are scored on the same rows and shown side by side.

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


def labelled(spec: str) -> tuple[str, str]:
    label, sep, value = spec.partition("=")
    if not sep or not label or not value:
        raise argparse.ArgumentTypeError(f"{spec!r}: write LABEL=PATH")
    return label, value


def row(label: str, rows: int, per_drafter: list[dict]) -> str:
    cells = [f"{s['top1'][0]:.3f} | {s['mean_accepted_len']['chain']:.2f}" for s in per_drafter]
    return f"| {label} | {rows:,} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heads", help="a heads directory")
    parser.add_argument("sets", nargs="+", type=labelled, help="LABEL=SHARD_FOLDER, one per held-out set")
    parser.add_argument("--label", default=None, help="the first drafter's name in the table (default: its folder)")
    parser.add_argument("--compare", action="append", type=labelled, default=[], metavar="LABEL=HEADS_DIR",
                        help="another drafter to score on the same sets (repeat for more)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    drafters = [(args.label or args.heads, args.heads), *args.compare]
    embed, lm_head = embedding_and_lm_head(resolve_model(args.model, dtype="fp32"))
    depths = set()
    scores: dict[str, dict[str, dict]] = {}
    for name, folder in drafters:
        heads = load_heads(folder)
        depths.add(heads.config.num_heads)
        # The chain alone: what every column shows, and the whole cost of scoring.
        scores[name] = {label: evaluate_heads(heads, list_shards(shards), lm_head=lm_head, embed=embed,
                                              trees=("chain",), prompt_lookup=None)
                        for label, shards in args.sets}
    if len(depths) != 1:
        parser.error(f"the drafters draft {sorted(depths)} deep: compare drafters of one depth")
    depth = depths.pop()
    header = ("| held-out set / source | positions | "
              + " | ".join(f"{name}: depth-1 top-1 | chain of {depth}" for name, _ in drafters)
              + " |\n|---|---|" + "---|---|" * len(drafters))
    lines, results = [], {}
    for label, shards in args.sets:
        per_drafter = [scores[name][label] for name, _ in drafters]
        lines.append(row(f"**{label}**", per_drafter[0]["rows"], per_drafter))
        categories = sorted(per_drafter[0].get("per_category", {}))
        if len(categories) > 1:
            lines += [row(f"&nbsp;&nbsp;{c}", per_drafter[0]["per_category"][c]["rows"],
                          [s["per_category"][c] for s in per_drafter]) for c in categories]
        results[label] = {"folder": shards, **{name: {k: v for k, v in scores[name][label].items() if k != "rank_accuracy"}
                                               for name, _ in drafters}}
    run = stamp()
    names = "; ".join(f"{name} = {folder}" if name != folder else folder for name, folder in drafters)
    table = f"{names}; {describe(run)}\n\n`{run['command']}`\n\n{header}\n" + "\n".join(lines)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"stamp": run, "drafters": dict(drafters), "sets": results}, indent=1)
                                   + "\n")


if __name__ == "__main__":
    main()
