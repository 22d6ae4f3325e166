"""Head kinds side by side on the held-out answers: per-depth conditional top-1 (the chance
depth i is right when depths 1..i-1 were), the chain's mean accepted length for k = 2..6,
parameters, and one draft step's time at batch 1.

The answers are the target's own greedy answers, teacher-forced (vllm_mtpspec_train/evaluate.py);
a chain of k drafts at answer row r keeps its drafts up to the first wrong one, plus the
target's token, and the next step starts after them. Parallel heads draft as many depths
as they have; an attention block is applied again for every deeper draft, so it runs to
any depth (past the depths it was trained on too).

A draft step is what the drafter runs for one request: parallel heads' layers and one
projection over all depths; sequential heads' one layer and one projection per depth; the
block's extension by one accepted entry, then one block step and one projection per deeper
depth (over the draft vocabulary where the heads have one).

Sequential heads (and the block) are scored along the answer's chain: each depth reads the
answer's token before it, which is the draft whenever the chain is still right.

    python benchmarks/head_kinds.py --heads vllm_mtpspec/shipped_heads/smollm2-135m-instruct,runs/block-v1 \\
        --shards runs/sd-ctx/held-out --json benchmarks/results/head_kinds.json \\
        --markdown benchmarks/results/head_kinds.md
"""
import argparse
import dataclasses
import json
import platform
from pathlib import Path

import torch
from timing import median_ms

from vllm_mtpspec.checkpoint import load_heads
from vllm_mtpspec.cli import heads_summary
from vllm_mtpspec.config import HeadsConfig
from vllm_mtpspec.models import resolve_model
from vllm_mtpspec.shards import list_shards
from vllm_mtpspec.tree import chain_tree
from vllm_mtpspec.weights import embedding_and_lm_head
from vllm_mtpspec_train.evaluate import conditional_hits, draft_logits_along, replay_tree

MAX_K = 6


def deeper(heads, depth: int):
    """An attention block drafting `depth` depths (same weights); parallel heads as they are."""
    if not heads.config.kind.keeps_context or depth == heads.num_heads:
        return heads
    config = HeadsConfig.from_dict({**heads.config.to_dict(), "num_heads": depth,
                                    "temperatures": [heads.config.temperatures[-1]] * depth})
    out = type(heads)(config)
    out.load_state_dict(heads.state_dict())
    return out.eval()


@torch.no_grad()
def score(heads, shards, lm_head, embed) -> dict:
    k = heads.num_heads
    project = heads.lm_head_for(lm_head)
    hits, asked = torch.zeros(k), torch.zeros(k)
    lengths = {depth: [] for depth in range(2, k + 1)}
    for file in shards:
        shard = torch.load(file, weights_only=True)
        offsets = shard["offsets"].tolist()
        for j in range(len(offsets) - 1):
            tokens = shard["tokens"][offsets[j]:offsets[j + 1]].long()
            top1 = torch.empty(tokens.numel(), k, dtype=torch.long)
            for rows, logits in draft_logits_along(heads, shard, j, project, embed):
                top1[rows] = logits.argmax(-1)
            h, a = conditional_hits(top1, tokens)
            hits += h
            asked += a
            for depth in lengths:
                lengths[depth].extend(replay_tree(chain_tree(depth), top1[:, :depth], tokens))
    return {
        "conditional_top1": [round(float(h / max(a, 1)), 4) for h, a in zip(hits, asked)],
        "chain_accepted": {depth: round(sum(v) / max(len(v), 1), 4) for depth, v in lengths.items()},
    }


@torch.no_grad()
def draft_step_ms(heads, lm_head, embed, repeats: int, context: int = 256) -> float:
    project = heads.lm_head_for(lm_head)
    d, k = heads.config.hidden_size, heads.num_heads
    h, token = torch.randn(1, d), torch.randint(0, embed.shape[0], (1,))
    if heads.config.kind.keeps_context:
        # As the proposer drafts: fused products, a drafted token's input half from a table.
        heads.prepare_drafting(None if heads.draft_vocab is None else embed[heads.draft_vocab])
        cache = heads.empty_cache()
        n = len(heads.feature_layers)  # states entering target layers, where the block reads them
        layers = (lambda rows: torch.randn(rows, n, d)) if n else (lambda rows: None)
        heads.extend(cache, torch.randn(context, d), embed[torch.randint(0, embed.shape[0], (context,))], layers(context))
        newest_layers = layers(1)

        def step():
            newest = heads.extend(cache, h, embed[token], newest_layers)[-1:]
            heads.draft_chains([cache], newest, k, project, lambda t: embed[t], heads.draft_vocab)
            heads.truncate(cache, context)  # stay at `context` entries
    else:
        e = embed[token] if heads.config.token_conditioned else None

        def step():
            heads.draft_logits(h, e, k, project, lambda t: embed[t], heads.draft_vocab).argmax(-1)
    return median_ms(step, repeats)


def label(heads, path: str) -> str:
    kind = heads.config.head_kind
    vocab = f", vocab {heads.config.draft_vocab_size}" if heads.config.draft_vocab_size else ""
    quant = heads.config.quantization
    int2 = f", int2 {quant.method} g{quant.group_size}" if quant else ""
    return f"{kind} [{Path(path).name}]{vocab}{int2}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", required=True, help="heads directories, comma-separated")
    parser.add_argument("--shards", default="runs/sd-ctx/held-out",
                        help="held-out shards with prompt rows (python -m vllm_mtpspec_train.data --context-rows 512)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    embed, lm_head = embedding_and_lm_head(resolve_model("smollm2-135m-instruct", dtype="fp32"))
    shards = list_shards(args.shards)
    rows = []
    for path in args.heads.split(","):
        heads = load_heads(path).float().eval()
        sized = deeper(heads, MAX_K)
        scores = score(sized, shards, lm_head, embed)
        summary = heads_summary(path)
        rows.append({
            "heads": path, "label": label(heads, path), "head_kind": heads.config.head_kind,
            "parameters": summary["parameters"], "bytes_on_disk": summary["bytes_on_disk"],
            "quantization": summary["quantization"], "trained_depths": heads.num_heads,
            **scores, "draft_step_ms_b1": round(draft_step_ms(heads, lm_head, embed, args.repeats), 2),
            "block": dataclasses.asdict(heads.config.block) if heads.config.block else None,
        })
        print(json.dumps(rows[-1]), flush=True)
    report = {"cpu": platform.processor() or platform.machine(), "threads": args.threads, "shards": args.shards,
              "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        lines = ["| heads | parameters | on disk | conditional top-1 by depth | "
                 "chain accepted, k = 2 / 3 / 4 / 5 / 6 | draft step at batch 1 (ms, depth = trained depths) |",
                 "|---|---|---|---|---|---|"]
        for row in rows:
            accepted = " / ".join(f"{row['chain_accepted'].get(k, float('nan')):.3f}" if k in row["chain_accepted"]
                                  else "-" for k in range(2, MAX_K + 1))
            lines.append(f"| {row['label']} | {row['parameters'] / 1e6:.1f}M | {row['bytes_on_disk'] / 1e6:.1f} MB | "
                         f"{' / '.join(f'{v:.3f}' for v in row['conditional_top1'])} | {accepted} | "
                         f"{row['draft_step_ms_b1']:.2f} |")
        Path(args.markdown).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
