"""Dataset-text data: the dataset's own answers read by the frozen target (teacher
forcing), as Medusa-1 trains its heads, for comparison with self-distillation (data.py).

The shards have the layout of vllm_mtpspec.shards, so the same training job reads them: tokens are the
dataset's answer tokens; hidden and top-k are what the target computes at each of them.
Train with kl_weight 0 for Medusa-1's plain cross-entropy on the text.
"""
from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from tqdm import tqdm

from vllm_mtpspec.prompts import Prompt
from vllm_mtpspec.shards import list_shards, shard_path, write_shard
from vllm_mtpspec.sharegpt import is_held_out, sharegpt_prompts
from vllm_mtpspec_train.answers import shard_from_answers
from vllm_mtpspec_train.data import encode_prompt
from vllm_mtpspec_train.prompts import sharegpt_answers

logger = logging.getLogger(__name__)


def generate_text_data(target, prompts: list[Prompt], answers: dict[str, str], out_dir: str | Path, *,
                       max_new_tokens: int = 256, max_prompt_tokens: int = 384, shard_size: int = 64,
                       top_k: int = 8) -> Path:
    out = Path(out_dir)
    prompts = [p for p in prompts if answers.get(p.id, "").strip()]
    num_shards = -(-len(prompts) // shard_size)
    todo = [i for i in range(num_shards) if not shard_path(out, i).is_file()]
    tokenizer = target.tokenizer
    done_tokens, started = 0, time.perf_counter()
    bar = tqdm(todo, desc="dataset-text shards", unit="shard")
    for index in bar:
        batch = prompts[index * shard_size:(index + 1) * shard_size]
        prompt_ids = [encode_prompt(tokenizer, prompt, max_prompt_tokens) for prompt in batch]
        answer_ids = [tokenizer.encode(answers[p.id], add_special_tokens=False)[:max_new_tokens] for p in batch]
        shard = shard_from_answers(target, [p.id for p in batch], [p.category for p in batch], prompt_ids,
                                   answer_ids, top_k=top_k)
        write_shard(out, index, shard)
        done_tokens += int(shard["tokens"].numel())
        bar.set_postfix(tokens=done_tokens, tok_per_s=f"{done_tokens / (time.perf_counter() - started):.0f}")
    logger.info("%d shards in %s", len(list_shards(out)), out)
    return out


def main(argv: list[str] | None = None) -> None:
    from vllm_mtpspec.target import load_target

    parser = argparse.ArgumentParser(
        prog="python -m vllm_mtpspec_train.text_data",
        description="Dataset-text training data (Medusa-1 style): ShareGPT's own answers to its prompts, read by "
                    "the frozen target; shards in the self-distillation layout, for the same training job.",
    )
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a known model name or an HF folder")
    parser.add_argument("--out", required=True, help="folder for shard-*.pt (existing shards are kept)")
    parser.add_argument("--max-prompts", type=int, default=None,
                        help="the first N train prompts: the same prompts as data.py's first N")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="answers are cut to this many tokens")
    parser.add_argument("--max-prompt-tokens", type=int, default=384)
    parser.add_argument("--shard-size", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    prompts = [p for p in sharegpt_prompts() if not is_held_out(p.id)][: args.max_prompts]
    generate_text_data(load_target(args.model), prompts, sharegpt_answers(), args.out,
                       max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                       shard_size=args.shard_size, top_k=args.top_k)


if __name__ == "__main__":
    main()
