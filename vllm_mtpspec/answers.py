"""Answer files: the target's own greedy answers as token ids, a few bytes per token.

The training job writes them (vllm_mtpspec_train.data) and rebuilds its training shards
from them (vllm_mtpspec_train.answers); the library reads them too (`mtpspec heads
draft-vocab` counts their tokens), so the format lives here. Answer file i holds the same
prompts as training shard i, so either side resumes where the other ends.

Layout (numpy .npz, no pickled objects):
  meta            JSON: format, the model's fingerprint, vocab size, generation settings
  ids, categories [n] str
  prompt_tokens, prompt_offsets [n + 1]   the prompts as the target saw them
  tokens, offsets [n + 1]                 the answers

meta "labels" says what the answers are, and so what a drafter learns at each of their tokens:
  "answer" (or absent): the target's own greedy answers; each answer token is the label.
  "target": human-written text (a data set's answers, a package's documentation) that the
            target reads; the label at each token is the target's own top-1 there, so the
            drafter still learns the target's choices, not the writer's.
"""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np

FORMAT = 1
LABELS = ("answer", "target")


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
    if meta.get("labels", "answer") not in LABELS:
        raise AnswersError(f"{path}: field 'labels' is {meta.get('labels')!r}, not one of {LABELS}; write the "
                           "file again with python -m vllm_mtpspec_train.data")
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
                        "python -m vllm_mtpspec_train.data")


def _split(flat: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    if offsets.ndim != 1 or offsets.size == 0 or offsets[0] != 0 or offsets[-1] != flat.size or (np.diff(offsets) < 0).any():
        raise ValueError("offsets do not cut the token array")
    values = flat.astype(np.int64).tolist()
    return [values[offsets[j]:offsets[j + 1]] for j in range(offsets.size - 1)]
