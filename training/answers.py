"""Answer files: the target's own greedy answers as token ids, a few bytes per token.

Training shards (data.py's layout) carry ~1.2 KB per token of hidden states and are
rebuilt, not kept: the answers are what costs generation time, so they are what the
repository keeps, and one teacher-forced pass of the frozen target over prompt + answer
gives back the hidden state and top-k distribution at every answer token. Answer file i
holds the same prompts as training shard i, so either side resumes where the other ends.

Layout (numpy .npz, no pickled objects):
  meta            JSON: format, the model's fingerprint, vocab size, generation settings
  ids, categories [n] str
  prompt_tokens, prompt_offsets [n + 1]   the prompts as the target saw them
  tokens, offsets [n + 1]                 the answers
"""
from __future__ import annotations

import json
import logging
import time
import zipfile
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from vllm_mtpspec.layer_states import recording_layer_inputs

logger = logging.getLogger(__name__)

FORMAT = 1


class AnswersError(ValueError):
    """An answer file that cannot be read, or that was made for another model."""


def answers_path(answers_dir: str | Path, index: int) -> Path:
    return Path(answers_dir) / f"answers-{index:05d}.npz"


def list_answer_files(answers_dir: str | Path) -> list[Path]:
    return sorted(Path(answers_dir).glob("answers-*.npz"))


def _concat(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    flat = np.fromiter((t for r in rows for t in r), dtype=np.int64, count=int(offsets[-1]))
    # uint16 halves the file for vocabularies up to 65,536 (SmolLM2's is 49,152).
    dtype = np.uint16 if flat.size == 0 or flat.max() < 1 << 16 else np.uint32
    return flat.astype(dtype), offsets


def write_answers(path: str | Path, ids: list[str], categories: list[str], prompt_ids: list[list[int]],
                  answers: list[list[int]], *, fingerprint: str, vocab_size: int, **settings) -> Path:
    """Keep prompts and their answers; settings (how they were generated) go into meta.
    Written whole or not at all."""
    prompt_tokens, prompt_offsets = _concat(prompt_ids)
    answer_tokens, answer_offsets = _concat(answers)
    meta = {"format": FORMAT, "model_fingerprint": fingerprint, "vocab_size": vocab_size, **settings}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    with open(tmp, "wb") as file:  # a file object: numpy would append .npz to a name
        np.savez_compressed(file, meta=np.array(json.dumps(meta, sort_keys=True)),
                            ids=np.array(ids, dtype=str), categories=np.array(categories, dtype=str),
                            prompt_tokens=prompt_tokens, prompt_offsets=prompt_offsets,
                            tokens=answer_tokens, offsets=answer_offsets)
    tmp.rename(path)
    return path


def read_answers(path: str | Path, *, fingerprint: str | None = None, vocab_size: int | None = None) -> dict:
    """{meta, ids, categories, prompt_ids, answers}; refused with the reason if the file is
    damaged or was made for another model than the one given by fingerprint."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            ids, categories = data["ids"].tolist(), data["categories"].tolist()
            prompts = _split(data["prompt_tokens"], data["prompt_offsets"])
            answers = _split(data["tokens"], data["offsets"])
    except UNREADABLE as err:
        raise _unreadable(path, err) from err
    if meta.get("format") != FORMAT:
        raise AnswersError(f"{path}: field 'format' is {meta.get('format')!r}, this version reads {FORMAT}")
    if fingerprint is not None and meta.get("model_fingerprint") != fingerprint:
        raise AnswersError(f"{path}: field 'model_fingerprint' is {meta.get('model_fingerprint')!r}, but the "
                           f"target's is {fingerprint!r}: these answers were made by another model; point "
                           "train_answers / held_out_answers (or --answers) at answers made by this one, or "
                           "generate new ones")
    if not len(ids) == len(categories) == len(prompts) == len(answers):
        raise AnswersError(f"{path}: {len(ids)} ids, {len(prompts)} prompts and {len(answers)} answers do not match")
    if vocab_size is not None and any(t >= vocab_size for seq in prompts + answers for t in seq):
        raise AnswersError(f"{path}: holds token ids beyond the target's vocabulary of {vocab_size}")
    return {"meta": meta, "ids": ids, "categories": categories, "prompt_ids": prompts, "answers": answers}


def prompts_answered(path: str | Path) -> list[str]:
    """The ids of the prompts an answer file answers (read without the tokens)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            return data["ids"].tolist()
    except UNREADABLE as err:
        raise _unreadable(path, err) from err


UNREADABLE = (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile)


def _unreadable(path, err) -> AnswersError:
    return AnswersError(f"{path}: not a readable answer file ({err}); delete it and generate it again with "
                        "python -m training.data")


def _split(flat: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    if offsets.ndim != 1 or offsets.size == 0 or offsets[0] != 0 or offsets[-1] != flat.size or (np.diff(offsets) < 0).any():
        raise ValueError("offsets do not cut the token array")
    values = flat.astype(np.int64).tolist()
    return [values[offsets[j]:offsets[j + 1]] for j in range(offsets.size - 1)]


@torch.inference_mode()
def teacher_forced(target, prompt_ids: list[int], answer_ids: list[int], top_k: int, context_rows: int = 0,
                   feature_layers: list[int] = ()):
    """(hidden [L, d], topk_ids [L, K], topk_logprobs [L, K], context [C, d], layers) at
    each answer token: the state at the position before it, where the target predicts it;
    the states at the last C = min(context_rows, P - 1) prompt positions before the
    answer's first row (each predicting the next prompt token), for draft modules that
    attend over the context; and with feature_layers, layers = (answer rows [L, n, d],
    context rows [C, n, d]) of the states entering those layers (else None)."""
    ids = torch.tensor([prompt_ids + answer_ids])
    first = len(prompt_ids) - 1
    rows = slice(first, first + len(answer_ids))
    context_rows_slice = slice(max(0, first - context_rows), first)
    decoder = target.model.get_decoder()
    # The decoder's output is after the final norm; the LM head runs on the answer rows only.
    with recording_layer_inputs(decoder, list(feature_layers)) as entering:
        states = decoder(input_ids=ids).last_hidden_state[0]
    hidden = states[rows]
    context = states[context_rows_slice]
    logits = target.model.get_output_embeddings()(hidden)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top_lp, top_ids = logprobs.topk(top_k, dim=-1)
    layers = None
    if feature_layers:
        stacked = torch.stack([entering[layer] for layer in feature_layers], 1)    # [P + L, n, d]
        layers = (stacked[rows].half(), stacked[context_rows_slice].half())
    return hidden.half(), top_ids.int(), top_lp.half(), context.half(), layers


def shard_from_answers(target, ids, categories, prompt_ids, answers, *, top_k: int, context_rows: int = 0,
                       feature_layers: list[int] = ()) -> dict:
    """A training shard (data.py's layout) read off the target along the given answers;
    with context_rows > 0 it also carries the prompt rows before each answer, and with
    feature_layers the states entering those layers at every row."""
    shard = {"ids": list(ids), "categories": list(categories), "prompt_ids": [list(p) for p in prompt_ids],
             "offsets": [0], "tokens": [], "hidden": [], "topk_ids": [], "topk_logprobs": []}
    contexts, context_offsets, answer_layers, context_layers = [], [0], [], []
    for prompt, answer in zip(prompt_ids, answers):
        hidden, top_ids, top_lp, context, layers = teacher_forced(target, prompt, answer, top_k, context_rows,
                                                                  feature_layers)
        shard["offsets"].append(shard["offsets"][-1] + len(answer))
        shard["tokens"].append(torch.tensor(answer, dtype=torch.int32))
        shard["hidden"].append(hidden)
        shard["topk_ids"].append(top_ids)
        shard["topk_logprobs"].append(top_lp)
        contexts.append(context)
        context_offsets.append(context_offsets[-1] + len(context))
        if layers is not None:
            answer_layers.append(layers[0])
            context_layers.append(layers[1])
    for key in ("tokens", "hidden", "topk_ids", "topk_logprobs"):
        shard[key] = torch.cat(shard[key])
    shard["offsets"] = torch.tensor(shard["offsets"], dtype=torch.int64)
    if context_rows > 0:
        shard["context_hidden"] = torch.cat(contexts)
        shard["context_offsets"] = torch.tensor(context_offsets, dtype=torch.int64)
    if feature_layers:
        shard["feature_layers"] = torch.tensor(list(feature_layers), dtype=torch.int64)
        shard["layer_hidden"] = torch.cat(answer_layers)
        if context_rows > 0:
            shard["context_layer_hidden"] = torch.cat(context_layers)
    return shard


def _newer(path: Path, than: Path) -> bool:
    return path.is_file() and path.stat().st_mtime >= than.stat().st_mtime


def shards_from_answers(model_dir: str | Path, answers_dir: str | Path, out_dir: str | Path, *,
                        top_k: int = 8, max_files: int | None = None, context_rows: int = 0,
                        feature_layers: list[int] = ()) -> list[Path]:
    """Rebuild the training shard of every answer file (the first max_files only, when set)
    that has none, or an older one (the target is loaded only if there is any); returns the
    shards written. context_rows: how many prompt rows before each answer to keep too;
    feature_layers: target layers whose input states to keep at every row too."""
    from training.data import shard_path, write_shard
    from vllm_mtpspec.checkpoint import model_fingerprint
    from vllm_mtpspec.target import load_target

    todo = [(int(f.stem.split("-")[1]), f) for f in list_answer_files(answers_dir)[:max_files]]
    todo = [(i, f) for i, f in todo if not _newer(shard_path(out_dir, i), f)]
    if not todo:
        return []
    target = load_target(str(model_dir), dtype="fp32")
    fingerprint = model_fingerprint(target.model_dir)
    vocab_size = target.model.config.vocab_size
    written, done_tokens, started = [], 0, time.perf_counter()
    bar = tqdm(todo, desc="shards from answers", unit="shard")
    for index, path in bar:
        kept = read_answers(path, fingerprint=fingerprint, vocab_size=vocab_size)
        shard = shard_from_answers(target, kept["ids"], kept["categories"], kept["prompt_ids"], kept["answers"],
                                   top_k=top_k, context_rows=context_rows, feature_layers=feature_layers)
        written.append(write_shard(out_dir, index, shard))
        done_tokens += int(shard["tokens"].numel())
        bar.set_postfix(tokens=done_tokens, tok_per_s=f"{done_tokens / (time.perf_counter() - started):.0f}")
    logger.info("rebuilt %d shards (%d answer tokens) from %s into %s", len(todo), done_tokens, answers_dir, out_dir)
    return written
