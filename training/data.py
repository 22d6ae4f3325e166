"""Self-distillation data: the target's own greedy answers to the training prompts, with
what the heads train on: the final hidden state behind every answer token and the
target's top-k next-token distribution there.

One vLLM pass yields all three: vLLM generates (offline batch), its logprobs give the
top-k distribution, and HiddenStateRecorder (a draft-nothing proposer) keeps the hidden
states. Work is cut into shards written whole or not at all; a stopped run resumes at
the first missing shard.

Shard layout (torch.save), for n answers of lengths L_j, N = sum L_j:
  ids, categories: [n] str;  prompt_ids: [n] list[int];  offsets: [n + 1] (into rows)
  tokens [N] int32        answer tokens, row r of answer j is its token r - offsets[j]
  hidden [N, d] fp16      the hidden state that produced tokens[r]
  topk_ids [N, K] int32, topk_logprobs [N, K] fp16: the target's distribution for tokens[r]
"""
from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_mtpspec.prompts import Prompt, apply_chat_template

logger = logging.getLogger(__name__)


def shard_path(out_dir: Path, index: int) -> Path:
    return out_dir / f"shard-{index:05d}.pt"


def list_shards(out_dir: str | Path) -> list[Path]:
    return sorted(Path(out_dir).glob("shard-*.pt"))


def generate_self_distillation(
    model_dir: str | Path,
    prompts: list[Prompt],
    out_dir: str | Path,
    *,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 384,
    shard_size: int = 64,
    top_k: int = 8,
    dtype: str = "float32",
    kv_cache_bytes: int = 1 << 30,
    max_num_seqs: int = 64,
) -> Path:
    from vllm import LLM, SamplingParams

    from training.recorder import RECORDER_PATH, pop_recorded

    # The recorder lives in the engine; in-process, collective_rpc reaches it directly
    # (across processes a callable would need pickle-based serialization).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    num_shards = -(-len(prompts) // shard_size)
    todo = [i for i in range(num_shards) if not shard_path(out, i).is_file()]
    if not todo:
        logger.info("all %d shards in %s are done", num_shards, out)
        return out
    llm = LLM(
        str(model_dir),
        dtype=dtype,
        max_model_len=max_prompt_tokens + max_new_tokens,
        kv_cache_memory_bytes=kv_cache_bytes,
        max_num_seqs=max_num_seqs,
        max_logprobs=top_k,
        enforce_eager=True,
        disable_log_stats=True,
        speculative_config={"method": "custom_class", "model": RECORDER_PATH, "num_speculative_tokens": 1},
    )
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, logprobs=top_k,
                            flat_logprobs=True, detokenize=False)
    done_tokens, started = 0, time.perf_counter()
    bar = tqdm(todo, desc="self-distillation shards", unit="shard")
    for index in bar:
        batch = prompts[index * shard_size : (index + 1) * shard_size]
        token_prompts = []
        for prompt in batch:
            ids = tokenizer.encode(apply_chat_template(tokenizer, prompt.text), add_special_tokens=False)
            token_prompts.append({"prompt_token_ids": ids[-max_prompt_tokens:]})
        outputs = llm.generate(token_prompts, params, use_tqdm=False)
        hidden = llm.collective_rpc(pop_recorded, args=([o.request_id for o in outputs],))[0]
        shard = _shard_from_outputs(batch, token_prompts, outputs, hidden, top_k)
        tmp = shard_path(out, index).with_suffix(".partial")
        torch.save(shard, tmp)
        tmp.rename(shard_path(out, index))
        done_tokens += int(shard["tokens"].numel())
        bar.set_postfix(tokens=done_tokens, tok_per_s=f"{done_tokens / (time.perf_counter() - started):.0f}")
    return out


def _shard_from_outputs(batch, token_prompts, outputs, hidden, top_k) -> dict:
    tokens, states, topk_ids, topk_lp, offsets = [], [], [], [], [0]
    for output in outputs:
        completion = output.outputs[0]
        ids = list(completion.token_ids)
        h = hidden[output.request_id]
        if h.shape[0] != len(ids):
            raise RuntimeError(f"request {output.request_id}: {h.shape[0]} hidden states for {len(ids)} tokens")
        lp = completion.logprobs  # FlatLogprobs: the sampled token first, then the top-k
        pos_ids = torch.full((len(ids), top_k), -1, dtype=torch.int32)
        pos_lp = torch.full((len(ids), top_k), float("-inf"), dtype=torch.float16)
        for pos in range(len(ids)):
            start, end = lp.start_indices[pos], lp.end_indices[pos]
            ranked = sorted(
                {t: v for t, v, r in zip(lp.token_ids[start:end], lp.logprobs[start:end], lp.ranks[start:end])}.items(),
                key=lambda kv: -kv[1],
            )[:top_k]
            pos_ids[pos, : len(ranked)] = torch.tensor([t for t, _ in ranked], dtype=torch.int32)
            pos_lp[pos, : len(ranked)] = torch.tensor([v for _, v in ranked], dtype=torch.float16)
        tokens.append(torch.tensor(ids, dtype=torch.int32))
        states.append(h)
        topk_ids.append(pos_ids)
        topk_lp.append(pos_lp)
        offsets.append(offsets[-1] + len(ids))
    return {
        "ids": [p.id for p in batch],
        "categories": [p.category for p in batch],
        "prompt_ids": [tp["prompt_token_ids"] for tp in token_prompts],
        "offsets": torch.tensor(offsets, dtype=torch.int64),
        "tokens": torch.cat(tokens),
        "hidden": torch.cat(states),
        "topk_ids": torch.cat(topk_ids),
        "topk_logprobs": torch.cat(topk_lp),
    }


def main(argv: list[str] | None = None) -> None:
    from training.prompts import is_held_out, load_training_prompts, sharegpt_prompts
    from vllm_mtpspec.models import resolve_model

    parser = argparse.ArgumentParser(
        prog="python -m training.data",
        description="Generate self-distillation data (answers, hidden states, top-k distributions) in resumable shards.",
    )
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a known model name or an HF folder")
    parser.add_argument("--prompts", default="sharegpt", help="'sharegpt' (the PyPI copy), or a JSONL / ShareGPT JSON / text file")
    parser.add_argument("--out", required=True, help="folder for shard-*.pt (existing shards are kept)")
    parser.add_argument("--max-prompts", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-tokens", type=int, default=384)
    parser.add_argument("--shard-size", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8, help="how much of the target's distribution to keep")
    parser.add_argument("--split", choices=("train", "held-out", "all"), default="train")
    # fp32: on CPUs without native bf16 (AVX2) vLLM's fp32 path is far faster.
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
    generate_self_distillation(
        model_dir, prompts, args.out, max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
        shard_size=args.shard_size, top_k=args.top_k, dtype={"fp32": "float32", "bf16": "bfloat16"}[args.dtype],
    )


if __name__ == "__main__":
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    main()
