"""Self-distillation data: the target's own greedy answers to the training prompts, with
what the heads train on: the final hidden state behind every answer token and the
target's top-k next-token distribution there.

Two passes. vLLM generates the answers (offline batch, greedy), kept as small answer
files (vllm_mtpspec.answers) that the repository can hold; then one teacher-forced pass of the
frozen target over prompt + answer gives the hidden states and top-k distributions, kept
as training shards. Generation is the slow part, so a machine that has the answer files
only runs the second pass. Both are cut into files written whole or not at all; a
stopped run resumes at the first missing one.

Shard layout: vllm_mtpspec.shards.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

from tqdm import tqdm

from vllm_mtpspec.answers import AnswersError, answers_path, prompts_answered, write_answers
from vllm_mtpspec.layer_states import parse_layer_list
from vllm_mtpspec.models import resolve_model
from vllm_mtpspec.prompts import Prompt, prompt_ids
from vllm_mtpspec.sharegpt import is_held_out
from vllm_mtpspec_train.answers import shards_from_answers
from vllm_mtpspec_train.prompts import TEXT_SOURCES, load_prompt_source

logger = logging.getLogger(__name__)


def encode_prompt(tokenizer, prompt: Prompt, max_prompt_tokens: int) -> list[int]:
    """The prompt as the target sees it (vllm_mtpspec.prompts.prompt_ids), within max_prompt_tokens."""
    return prompt_ids(tokenizer, prompt.text, prompt.history, max_prompt_tokens=max_prompt_tokens)


def answers_dir_for(out_dir: str | Path, answers_dir: str | Path | None = None) -> Path:
    return Path(answers_dir) if answers_dir is not None else Path(out_dir) / "answers"


def greedy_engine(model_dir: str | Path, *, dtype: str = "float32", max_model_len: int, kv_cache_bytes: int = 1 << 30,
                  max_num_seqs: int = 64):
    """The offline vLLM engine that writes a model's greedy answers."""
    from vllm import LLM

    # In-process engine: on a 2-core machine a separate engine-core process left the
    # worker short of CPU (~130 tok/s against ~270 in-process).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return LLM(str(model_dir), dtype=dtype, max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_bytes,
               max_num_seqs=max_num_seqs, enforce_eager=True, disable_log_stats=True)


def generate_answers(
    model_dir: str | Path,
    prompts: list[Prompt],
    answers_dir: str | Path,
    *,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 384,
    shard_size: int = 64,
    dtype: str = "float32",
    kv_cache_bytes: int = 1 << 30,
    max_num_seqs: int = 64,
    source: str | None = None,
) -> Path:
    """The target's greedy answers, one answer file per shard_size prompts (file i holds
    prompts[i * shard_size:(i + 1) * shard_size]); files already there are kept."""
    from vllm import SamplingParams

    from vllm_mtpspec.checkpoint import model_fingerprint

    out = Path(answers_dir)
    num_files = -(-len(prompts) // shard_size)
    todo = [i for i in range(num_files) if not _answered(out, i, prompts[i * shard_size:(i + 1) * shard_size])]
    if not todo:
        logger.info("all %d answer files in %s are done", num_files, out)
        return out
    llm = greedy_engine(model_dir, dtype=dtype, max_model_len=max_prompt_tokens + max_new_tokens,
                        kv_cache_bytes=kv_cache_bytes, max_num_seqs=max_num_seqs)
    tokenizer = llm.get_tokenizer()
    vocab_size = llm.llm_engine.model_config.get_vocab_size()
    fingerprint = model_fingerprint(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, detokenize=False)
    done_tokens, started = 0, time.perf_counter()
    bar = tqdm(todo, desc="self-distilled answers", unit="file")
    for index in bar:
        batch = prompts[index * shard_size:(index + 1) * shard_size]
        prompt_ids = [encode_prompt(tokenizer, prompt, max_prompt_tokens) for prompt in batch]
        file_started = time.perf_counter()
        # LLM.generate returns the outputs in the order of its inputs.
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        answers = [list(o.outputs[0].token_ids) for o in outputs]
        write_answers(answers_path(out, index), [p.id for p in batch], [p.category for p in batch], prompt_ids,
                      answers, fingerprint=fingerprint, vocab_size=vocab_size, max_new_tokens=max_new_tokens,
                      max_prompt_tokens=max_prompt_tokens, dtype=dtype, source=source,
                      generation_seconds=round(time.perf_counter() - file_started, 1))
        done_tokens += sum(len(a) for a in answers)
        bar.set_postfix(tokens=done_tokens, tok_per_s=f"{done_tokens / (time.perf_counter() - started):.0f}")
    del llm
    return out


def write_text_answers(
    model_dir: str | Path,
    texts: list[tuple[Prompt, str]],
    answers_dir: str | Path,
    *,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 384,
    shard_size: int = 64,
    source: str | None = None,
) -> Path:
    """Human-written answers as answer files with labels "target": each text tokenized as the
    target would read it after its prompt, cut to max_new_tokens (a whole one ends with the
    end-of-turn token, as the target's own answers do). Nothing is generated: the target
    labels the text when a drafter trains on it. File i holds texts[i * shard_size:...]."""
    from transformers import AutoTokenizer

    from vllm_mtpspec.checkpoint import model_fingerprint

    out = Path(answers_dir)
    prompts = [prompt for prompt, _ in texts]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    fingerprint = model_fingerprint(model_dir)
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    num_files = -(-len(texts) // shard_size)
    for index in tqdm([i for i in range(num_files) if not _answered(out, i, prompts[i * shard_size:(i + 1) * shard_size])],
                      desc="human-written answers", unit="file"):
        batch = texts[index * shard_size:(index + 1) * shard_size]
        prompt_ids = [encode_prompt(tokenizer, prompt, max_prompt_tokens) for prompt, _ in batch]
        answers = []
        for _, text in batch:
            ids = tokenizer.encode(text.strip(), add_special_tokens=False)
            answers.append(ids[:max_new_tokens] if len(ids) >= max_new_tokens else ids + [tokenizer.eos_token_id])
        write_answers(answers_path(out, index), [p.id for p, _ in batch], [p.category for p, _ in batch], prompt_ids,
                      answers, fingerprint=fingerprint, vocab_size=vocab_size, labels="target",
                      max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens, source=source)
    return out


def _answered(answers_dir: Path, index: int, prompts: list[Prompt]) -> bool:
    """Whether answer file `index` answers these prompts. A file of a longer prompt list
    (these prompts and more after them) serves; one that answers the first of them only
    (the last file of a shorter list) is made again; one that answers other prompts is
    refused: the folder belongs to another prompt list."""
    path = answers_path(answers_dir, index)
    if not path.is_file():
        return False
    answered, wanted = prompts_answered(path), [p.id for p in prompts]
    if answered[:len(wanted)] == wanted:
        return True
    if answered == wanted[:len(answered)]:
        return False
    first_apart = next(i for i, (a, w) in enumerate(zip(answered, wanted)) if a != w)
    raise AnswersError(
        f"{path}: field 'ids' answers other prompts than file {index} of this prompt list (they part at prompt "
        f"{first_apart} of file {index}: {answered[first_apart]!r} answered, {wanted[first_apart]!r} in this list): "
        "the prompt source, split, order or shard size differ. Give this prompt list its own answers folder "
        "(--answers, or 'train_answers' in the config); to make shards from answer files as they are, whatever "
        "list they answer, use --from-answers")


def generate_self_distillation(
    model_dir: str | Path,
    prompts: list[Prompt],
    out_dir: str | Path,
    *,
    answers_dir: str | Path | None = None,
    top_k: int = 8,
    context_rows: int = 0,
    feature_layers: list[int] = (),
    **generation,
) -> Path:
    """Training shards for the prompts in out_dir: answers generated where answers_dir
    (default out_dir/answers) lacks them, then read off the target. generation: the
    keyword arguments of generate_answers."""
    answers_dir = answers_dir_for(out_dir, answers_dir)
    generate_answers(model_dir, prompts, answers_dir, **generation)
    shards_from_answers(model_dir, answers_dir, out_dir, top_k=top_k, context_rows=context_rows,
                        feature_layers=feature_layers)
    return Path(out_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_mtpspec_train.data",
        description="Self-distillation data: the target's greedy answers (small answer files worth keeping), then "
                    "the hidden states and top-k distributions along them (training shards). Resumable: existing "
                    "answer files and shards are kept.",
    )
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a known model name or an HF folder")
    parser.add_argument("--prompts", default="sharegpt", help="'sharegpt' (first turns of the PyPI copy), 'sharegpt-later-turns' (every later turn, with "
                             "the conversation before it as context), 'dataframebench' (709 code tasks, the training split of "
                             "the PyPI package's wheel), 'package-docs' (installed packages' descriptions and functions), "
                             "'tasks' (translating, summarizing and multiple choice over training-side text), "
                             "'exams' (6,638 multiple-choice exam questions: ARC, OpenBookQA, CommonsenseQA), "
                             "or a JSONL / ShareGPT JSON / text file")
    parser.add_argument("--out", default=None,
                        help="folder for shard-*.pt (existing shards are kept); not needed with --human-text")
    parser.add_argument("--answers", default=None, help="folder for answers-*.npz (default: OUT/answers)")
    parser.add_argument("--answers-only", action="store_true",
                        help="generate answer files and stop: no hidden states, no shards")
    parser.add_argument("--human-text", action="store_true",
                        help="write the source's human-written answers (" + ", ".join(TEXT_SOURCES) + ") as answer "
                             "files in --answers instead of generating the target's own; the training job's online "
                             "path labels them with the target's top-1. Needs no vLLM, writes no shards")
    parser.add_argument("--max-prompts", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-tokens", type=int, default=384)
    parser.add_argument("--shard-size", type=int, default=64)
    parser.add_argument("--kv-cache-gib", type=int, default=1,
                        help="vLLM's KV cache; long prompts want more to keep max_num_seqs of them running")
    parser.add_argument("--top-k", type=int, default=8, help="how much of the target's distribution to keep")
    parser.add_argument("--context-rows", type=int, default=0,
                        help="also keep the states of up to this many prompt rows before each answer in the shards "
                             "(what a draft block with attention reads as context); 0: answer rows only")
    parser.add_argument("--feature-layers", type=parse_layer_list, default=[],
                        help="comma-separated target layers (e.g. 2,15,27) whose input states the shards keep at every "
                             "row too: what a draft block with block.feature_layers reads (EAGLE-3)")
    parser.add_argument("--from-answers", action="store_true",
                        help="build shards from the answer files in --answers alone, whatever prompts made them "
                             "(an audited held-out folder, say): no prompt source is read, nothing is generated")
    parser.add_argument("--split", choices=("train", "held-out", "all"), default="train")
    # fp32: on CPUs without native bf16 (AVX2) vLLM's fp32 path is far faster.
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not args.out and not args.human_text:
        parser.error("--out: give the folder for the shards (and, without --answers, the answer files)")
    if args.from_answers:
        if not args.answers:
            parser.error("--from-answers reads the answer files of --answers: give that folder")
        shards_from_answers(resolve_model(args.model, dtype=args.dtype), args.answers, args.out, top_k=args.top_k,
                            context_rows=args.context_rows, feature_layers=args.feature_layers)
        return
    if args.human_text:
        if args.prompts not in TEXT_SOURCES or not args.answers:
            parser.error(f"--human-text writes the texts of --prompts {' or '.join(TEXT_SOURCES)} into --answers: "
                         f"give both (--prompts is {args.prompts!r}, --answers {args.answers!r})")
        texts = [(p, text) for p, text in TEXT_SOURCES[args.prompts]()
                 if args.split == "all" or is_held_out(p.id) == (args.split == "held-out")][: args.max_prompts]
        logger.info("%d human-written answers -> %s", len(texts), args.answers)
        write_text_answers(resolve_model(args.model, dtype=args.dtype), texts, args.answers,
                           max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                           shard_size=args.shard_size, source=f"{args.prompts} (human-written)")
        return
    prompts = load_prompt_source(args.prompts)
    if args.split != "all":
        want_held_out = args.split == "held-out"
        prompts = [p for p in prompts if is_held_out(p.id) == want_held_out]
    prompts = prompts[: args.max_prompts]
    model_dir = resolve_model(args.model, dtype=args.dtype)
    answers_dir = answers_dir_for(args.out, args.answers)
    logger.info("%d prompts -> answers in %s%s", len(prompts), answers_dir,
                "" if args.answers_only else f", shards in {args.out}")
    generation = dict(max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                      shard_size=args.shard_size, source=args.prompts, kv_cache_bytes=args.kv_cache_gib << 30, dtype={"fp32": "float32", "bf16": "bfloat16"}[args.dtype])
    if args.answers_only:
        generate_answers(model_dir, prompts, answers_dir, **generation)
    else:
        generate_self_distillation(model_dir, prompts, args.out, answers_dir=answers_dir, top_k=args.top_k,
                                   context_rows=args.context_rows, feature_layers=args.feature_layers, **generation)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    main()
