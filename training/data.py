"""Self-distillation data: the target's own greedy answers to the training prompts.

The heads must learn what the target will say, not what the data set says, so the target
answers every prompt (vLLM offline batch generation) and those answers are what the heads
are trained on. Work is cut into shards of prompts written as JSONL; a shard that exists
is never generated again, so a stopped run resumes where it was.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

from tqdm import tqdm

from vllm_mtpspec.prompts import Prompt, apply_chat_template

logger = logging.getLogger(__name__)


def shard_path(out_dir: Path, index: int) -> Path:
    return out_dir / f"shard-{index:05d}.jsonl"


def read_shards(out_dir: str | Path) -> list[dict]:
    rows = []
    for file in sorted(Path(out_dir).glob("shard-*.jsonl")):
        with open(file) as f:
            rows.extend(json.loads(line) for line in f if line.strip())
    return rows


def generate_self_distillation(
    model_dir: str | Path,
    prompts: list[Prompt],
    out_dir: str | Path,
    *,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 384,
    shard_size: int = 128,
    dtype: str = "float32",
    kv_cache_bytes: int = 1 << 30,
    max_num_seqs: int = 64,
    llm=None,
) -> Path:
    """Writes shard-*.jsonl with prompt_ids / response_ids per prompt; resumes."""
    from vllm import LLM, SamplingParams

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    num_shards = -(-len(prompts) // shard_size)
    todo = [i for i in range(num_shards) if not shard_path(out, i).is_file()]
    if not todo:
        logger.info("all %d shards in %s are done", num_shards, out)
        return out
    if llm is None:
        llm = LLM(
            str(model_dir),
            dtype=dtype,
            max_model_len=max_prompt_tokens + max_new_tokens,
            kv_cache_memory_bytes=kv_cache_bytes,
            enforce_eager=True,
            max_num_seqs=max_num_seqs,
            disable_log_stats=True,
        )
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, detokenize=False)
    done_tokens = 0
    started = time.perf_counter()
    bar = tqdm(todo, desc="self-distillation shards", unit="shard")
    for index in bar:
        batch = prompts[index * shard_size : (index + 1) * shard_size]
        token_prompts = []
        for prompt in batch:
            ids = tokenizer.encode(apply_chat_template(tokenizer, prompt.text), add_special_tokens=False)
            token_prompts.append({"prompt_token_ids": ids[-max_prompt_tokens:]})
        outputs = llm.generate(token_prompts, params, use_tqdm=False)
        tmp = shard_path(out, index).with_suffix(".partial")
        with open(tmp, "w") as f:
            for prompt, tp, output in zip(batch, token_prompts, outputs):
                response = list(output.outputs[0].token_ids)
                done_tokens += len(response)
                f.write(json.dumps({
                    "id": prompt.id,
                    "category": prompt.category,
                    "prompt_ids": tp["prompt_token_ids"],
                    "response_ids": response,
                }) + "\n")
        tmp.rename(shard_path(out, index))  # a shard appears whole or not at all
        rate = done_tokens / (time.perf_counter() - started)
        bar.set_postfix(tokens=done_tokens, tok_per_s=f"{rate:.0f}")
    return out


def main(argv: list[str] | None = None) -> None:
    from training.prompts import is_held_out, load_training_prompts, sharegpt_prompts
    from vllm_mtpspec.models import resolve_model

    parser = argparse.ArgumentParser(
        prog="python -m training.data",
        description="Generate self-distillation data: the target's greedy answers to prompts, in resumable shards.",
    )
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a known model name or an HF folder")
    parser.add_argument("--prompts", default="sharegpt", help="'sharegpt' (the PyPI copy), or a JSONL / ShareGPT JSON / text file")
    parser.add_argument("--out", required=True, help="folder for shard-*.jsonl (existing shards are kept)")
    parser.add_argument("--max-prompts", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--shard-size", type=int, default=128)
    parser.add_argument("--split", choices=("train", "held-out", "all"), default="train")
    # fp32: on CPUs without native bf16 (AVX2) vLLM's fp32 path is ~4x faster at batch 16.
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    prompts = sharegpt_prompts() if args.prompts == "sharegpt" else load_training_prompts(args.prompts)
    if args.split != "all":
        want_held_out = args.split == "held-out"
        prompts = [p for p in prompts if is_held_out(p.id) == want_held_out]
    prompts = prompts[: args.max_prompts]
    model_dir = resolve_model(args.model, dtype=args.dtype)
    logger.info("%d prompts -> %s", len(prompts), args.out)
    generate_self_distillation(model_dir, prompts, args.out, max_new_tokens=args.max_new_tokens,
                               shard_size=args.shard_size, dtype={"fp32": "float32", "bf16": "bfloat16"}[args.dtype])


if __name__ == "__main__":
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    main()
