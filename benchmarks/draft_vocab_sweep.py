"""Draft vocabularies of N tokens for one heads directory: coverage, held-out accuracy,
accepted length and drafting time, N by N.

The vocabulary is the N most frequent tokens of the training answers (`mtpspec heads
draft-vocab`); coverage is the share of held-out answer tokens it holds; top-1 and the
chain's accepted length come from the held-out scorer (vllm_mtpspec_train/evaluate.py, the target's
greedy answers teacher-forced); drafting time is one draft step of the heads (their
layers and the projection onto the N rows, as the proposer runs them: head_kinds.draft_step_ms)
at batch 1.

    python benchmarks/draft_vocab_sweep.py --sizes 4096,8192,16384,32768,0 \\
        --json benchmarks/results/draft_vocab_sweep.json --markdown benchmarks/results/draft_vocab_sweep.md
"""
import argparse
import json
import platform
from pathlib import Path

import torch
from head_kinds import draft_step_ms

from vllm_mtpspec.checkpoint import load_heads
from vllm_mtpspec.cli import answer_token_arrays
from vllm_mtpspec.draft_vocab import coverage, most_frequent_tokens
from vllm_mtpspec.models import resolve_model
from vllm_mtpspec.shards import list_shards
from vllm_mtpspec.shipped import shipped_heads_dir
from vllm_mtpspec.weights import embedding_and_lm_head
from vllm_mtpspec_train.evaluate import evaluate_heads

DATA = "data/self-distilled/smollm2-135m-instruct"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default=str(shipped_heads_dir()))
    parser.add_argument("--sizes", default="4096,8192,16384,32768,0", help="N per row; 0 is the whole vocabulary")
    parser.add_argument("--train-answers", default=f"{DATA}/train")
    parser.add_argument("--held-out-answers", default=f"{DATA}/held-out")
    parser.add_argument("--held-out-shards", default="runs/sharegpt-sd/held-out",
                        help="teacher-forced shards of the held-out answers (python -m vllm_mtpspec_train.data)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = resolve_model("smollm2-135m-instruct", dtype="fp32")
    embed, lm_head = embedding_and_lm_head(model)
    heads = load_heads(args.heads).float().eval()
    vocab = heads.config.vocab_size
    train = answer_token_arrays(args.train_answers, vocab_size=vocab)
    held_out = answer_token_arrays(args.held_out_answers, vocab_size=vocab)
    ranked = most_frequent_tokens(train, vocab_size=vocab, size=vocab)
    shards = list_shards(args.held_out_shards)
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        sized = heads if size in (0, vocab) else heads.with_draft_vocab(ranked[:size])
        n = size or vocab
        scores = evaluate_heads(sized, shards, lm_head=lm_head, embed=embed, trees=("chain",))
        rows.append({
            "draft_vocab_size": n,
            "coverage_held_out": round(coverage(held_out, ranked[:n], vocab_size=vocab), 4),
            "top1": scores["top1"],
            "chain_accepted_length": scores["mean_accepted_len"]["chain"],
            "chain_lookup_accepted_length": scores["mean_accepted_len"]["chain+lookup"],
            "draft_step_ms_batch1": round(draft_step_ms(sized, lm_head, embed, args.repeats), 3),
        })
        print(json.dumps(rows[-1]), flush=True)
    machine = f"{platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}"
    if args.json:
        Path(args.json).write_text(json.dumps({"heads": args.heads, "machine": machine, "rows": rows}, indent=1) + "\n")
    if args.markdown:
        lines = [f"## Draft vocabulary sweep: {args.heads}", "",
                 f"{len(train)} training answers counted; held-out: {len(held_out)} answers; {machine}", "",
                 "| N | held-out coverage | top-1 per head | chain accepted length | chain+lookup | "
                 "draft step, batch 1 (ms) |", "|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['draft_vocab_size']} | {r['coverage_held_out']:.1%} | "
                         f"{' / '.join(f'{t:.3f}' for t in r['top1'])} | {r['chain_accepted_length']:.3f} | "
                         f"{r['chain_lookup_accepted_length']:.3f} | {r['draft_step_ms_batch1']:.2f} |")
        Path(args.markdown).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
