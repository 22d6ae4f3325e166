"""Heads trained different ways, side by side on the same held-out prompts.

Each run directory is what `mtpspec train --config vllm_mtpspec_train/configs/ablations/NAME.json`
wrote (its train_summary.json holds the held-out metrics of the FP heads and their INT2
copy). Medusa-1's published per-head top-1 for Vicuna-7B is printed alongside.

    python benchmarks/heads_ablation.py runs/ablations/* --markdown benchmarks/results/heads_ablation.md
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

MEDUSA_VICUNA_7B_TOP1 = (0.56, 0.32, 0.20, 0.15)  # the Medusa paper (Cai et al., 2024), per head


def describe(config: dict) -> str:
    data = "dataset text" if config.get("kl_weight") == 0.0 else "self-distilled"
    tied = "tied" if config.get("tied", True) else "untied"
    layer = f", hidden layer {config['mlp_size']}" if config.get("mlp_size") else ""
    return f"{data}, {tied}, {config.get('head_input', 'hidden')}{layer}"


def rows(run_dirs: list[Path]) -> list[dict]:
    out = []
    for run in run_dirs:
        summary_file = run / "train_summary.json"
        if not summary_file.is_file():
            continue
        summary = json.loads(summary_file.read_text())
        config = summary["config"]
        for precision, metrics in summary["held_out"].items():
            out.append({
                "run": run.name, "heads": describe(config), "precision": precision,
                "train_rows": summary.get("train_rows"), "top1": metrics["top1"], "top5": metrics["top5"],
                "chain": metrics["mean_accepted_len"]["chain"], "consensus": metrics["mean_accepted_len"]["consensus"],
            })
    return out


def markdown(table: list[dict]) -> str:
    lines = ["| run | heads | precision | training rows | top-1 per head | top-5 per head "
             "| mean accepted length: chain | consensus |", "|---|---|---|---|---|---|---|---|"]
    for r in table:
        fmt = lambda xs: " / ".join(f"{x:.3f}".lstrip("0") for x in xs)  # noqa: E731
        lines.append(f"| {r['run']} | {r['heads']} | {r['precision']} | {r['train_rows']:,} | {fmt(r['top1'])} "
                     f"| {fmt(r['top5'])} | {r['chain']:.3f} | {r['consensus']:.3f} |")
    medusa = " / ".join(f"{x:.2f}".lstrip("0") for x in MEDUSA_VICUNA_7B_TOP1)
    lines.append(f"| Medusa-1, Vicuna-7B (published) | dataset text, untied, hidden | fp16 | - | {medusa} | - | - | - |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories holding train_summary.json")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    table = markdown(rows(args.runs))
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")


if __name__ == "__main__":
    main()
