"""Fit a draft block's copy bias (vllm_mtpspec/copy_bias.py) along the target's own answers.

The block's logits along each answer are computed once, without a bias; then each repeat
length's bias is chosen from a grid, one length at a time (longest first, twice round), to
maximise the tokens a chain keeps per step when greedy decoding is replayed teacher-forced
(vllm_mtpspec_train/evaluate.py). Fit on answers from other sources than the ones the
drafter is scored on, so that what it is scored on stays held out.

    python -m vllm_mtpspec_train.fit_copy_bias HEADS_DIR --shards FOLDER[,FOLDER...] --out NEW_HEADS_DIR

The new folder is a copy of the heads with copy_bias set in config.json (weights unchanged).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from vllm_mtpspec.checkpoint import CONFIG_FILE, load_heads
from vllm_mtpspec.copy_bias import REPEAT_LENGTHS, repeat_bucket, repeats_along
from vllm_mtpspec.models import resolve_model
from vllm_mtpspec.shards import list_shards
from vllm_mtpspec.weights import embedding_and_lm_head
from vllm_mtpspec_train.evaluate import block_answer_logits

logger = logging.getLogger(__name__)

# Logit biases tried per repeat length; -inf: none. ALWAYS is past any gap between two
# logits of these models: the continuation is drafted whenever the chain follows it.
ALWAYS = 100.0
BIAS_GRID = (-math.inf, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, ALWAYS)


@dataclass
class AnswerRows:
    """What the fit needs of one answer, per row r and depth i, and where the answer is from."""
    id: str                  # the prompt's id in its shard
    category: str            # its source or kind of use
    prompt: np.ndarray       # [p] the prompt's tokens, which the answer follows
    answer: np.ndarray       # [n] the answer's tokens
    top1: np.ndarray         # [n, k] the block's own top-1, in target ids
    copy: np.ndarray         # [n, k] the continuation of row r's longest earlier repeat, -1 past its end
    gap: np.ndarray          # [n, k] top-1 logit minus the continuation's (inf where there is none)
    bucket: np.ndarray       # [n] the repeat's REPEAT_LENGTHS bucket (0: no repeat)


@torch.no_grad()
def answer_rows(block, shard_files: list[Path], lm_head: torch.Tensor, embed: torch.Tensor) -> list[AnswerRows]:
    block.config.copy_bias = None  # the logits without a bias: the fit adds it
    project = block.lm_head_for(lm_head)
    k = block.num_heads
    rows = []
    for file in tqdm(shard_files, desc="block logits along answers", unit="shard"):
        shard = torch.load(file, weights_only=True)
        offsets = shard["offsets"].tolist()
        for j, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
            answer = shard["tokens"][start:end].numpy().astype(np.int64)
            prompt = list(shard["prompt_ids"][j])
            context = np.asarray(prompt + answer.tolist())
            n = len(answer)
            lengths, copy = repeats_along(context, len(prompt), n, k)
            bucket = np.array([repeat_bucket(int(length)) for length in lengths], dtype=np.int64)
            top1 = np.empty((n, k), dtype=np.int64)
            gap = np.full((n, k), np.inf, dtype=np.float32)
            for rows_slice, logits in block_answer_logits(block, shard, j, project, embed):
                best, top = logits.max(-1)
                top1[rows_slice] = top.numpy()
                own = torch.from_numpy(copy[rows_slice])
                theirs = logits.gather(-1, own.clamp_min(0)[..., None])[..., 0]
                gap[rows_slice] = np.where(copy[rows_slice] >= 0, (best - theirs).numpy(), np.inf)
            rows.append(AnswerRows(shard["ids"][j], shard["categories"][j], np.asarray(prompt), answer, top1,
                                    copy, gap, bucket))
    return rows


def accepted_at(a: AnswerRows, r: int, biases: dict[int, float], depth: int) -> int:
    """The draft tokens a greedy chain of `depth` keeps at answer row r, teacher-forced, with
    these biases (bucket -> bias): at each depth the continuation replaces the top-1 where its
    logit plus the bias reaches the top-1's, while the chain has followed the continuation."""
    n = len(a.answer)
    bias = biases.get(int(a.bucket[r]), -math.inf)
    accepted, following = 0, True
    while accepted < depth and r + accepted + 1 < n:
        copy = a.copy[r, accepted]
        use_copy = following and copy >= 0 and a.gap[r, accepted] <= bias
        drafted = copy if use_copy else a.top1[r, accepted]
        following = following and drafted == copy
        if drafted != a.answer[r + accepted + 1]:
            break
        accepted += 1
    return accepted


def tokens_per_step(rows: list[AnswerRows], biases: dict[int, float], depth: int) -> float:
    """Greedy decoding replayed along the answers with chains of `depth` (accepted_at): the
    tokens each step emits, the accepted drafts and the target's own next token, on average."""
    steps = emitted = 0
    for a in rows:
        r = 0
        while r < len(a.answer) - 1:
            accepted = accepted_at(a, r, biases, depth)
            steps += 1
            emitted += accepted + 1
            r += accepted + 1
    return emitted / max(steps, 1)


def fit(rows: list[AnswerRows], depth: int, sweeps: int = 2) -> tuple[dict[int, float], float, float]:
    """(bias per repeat length with one, tokens a step without any, with them)."""
    biases = {n: -math.inf for n in REPEAT_LENGTHS}
    before = tokens_per_step(rows, biases, depth)
    for _ in range(sweeps):
        for n in reversed(REPEAT_LENGTHS):
            biases[n] = max(BIAS_GRID, key=lambda b: tokens_per_step(rows, {**biases, n: b}, depth))
    return {n: b for n, b in biases.items() if b != -math.inf}, before, tokens_per_step(rows, biases, depth)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("heads", help="a draft block's heads directory")
    parser.add_argument("--shards", required=True,
                        help="comma-separated shard folders (built with --context-rows) of answers to fit on")
    parser.add_argument("--depth", type=int, default=3, help="the chain depth to fit for (default 3)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", required=True, help="where the copy of the heads with copy_bias goes")
    parser.add_argument("--json", action="store_true", help="print only the fit's result as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.json else logging.INFO,
                        format="%(asctime)s %(name)s: %(message)s")
    block = load_heads(args.heads).float().eval()
    if not block.config.kind.takes_copy_bias:
        parser.error(f"{args.heads}: head_kind={block.config.head_kind!r}; only an attention draft block takes a "
                     "copy bias")
    if not 1 <= args.depth <= block.num_heads:
        parser.error(f"--depth {args.depth}: the block drafts 1..{block.num_heads} deep")
    out = Path(args.out)
    if out.exists():
        parser.error(f"--out {out} exists: give a new folder")
    files = [f for folder in args.shards.split(",") for f in list_shards(folder)]
    embed, lm_head = embedding_and_lm_head(resolve_model(args.model, dtype="fp32"))
    rows = answer_rows(block, files, lm_head, embed)
    biases, before, after = fit(rows, args.depth)
    shutil.copytree(args.heads, out)
    config = json.loads((out / CONFIG_FILE).read_text())
    config["copy_bias"] = {str(n): b for n, b in biases.items()}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    load_heads(out)  # the config it wrote must load
    result = {"heads": str(out), "copy_bias": config["copy_bias"], "depth": args.depth, "answers": len(rows),
              "positions": int(sum(len(a.answer) for a in rows)), "tokens_per_step_before": round(before, 4),
              "tokens_per_step_after": round(after, 4), "shards": args.shards}
    if args.json:
        print(json.dumps(result))
    else:
        logger.info("fitted on %d answers (%d positions): chain of %d keeps %.3f tokens a step without a copy "
                    "bias, %.3f with %s; wrote %s", result["answers"], result["positions"], args.depth, before,
                    after, result["copy_bias"], out)


if __name__ == "__main__":
    main()
