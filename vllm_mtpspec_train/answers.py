"""Training shards from answer files (vllm_mtpspec.answers holds their format).

Training shards (vllm_mtpspec.shards' layout) carry ~1.2 KB per token of hidden states and
are rebuilt, not kept: the answers are what costs generation time, so they are what the
repository keeps, and one teacher-forced pass of the frozen target over prompt + answer
gives back the hidden state and top-k distribution at every answer token.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_mtpspec.answers import AnswersError, list_answer_files, read_answers
from vllm_mtpspec.layer_states import recording_layer_inputs, stored_layer_states
from vllm_mtpspec.shards import shard_path, write_shard

logger = logging.getLogger(__name__)


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
        layers = (stored_layer_states(stacked[rows]), stored_layer_states(stacked[context_rows_slice]))
    return hidden.half(), top_ids.int(), top_lp.half(), context.half(), layers


def shard_from_answers(target, ids, categories, prompt_ids, answers, *, top_k: int, context_rows: int = 0,
                       feature_layers: list[int] = ()) -> dict:
    """A training shard (vllm_mtpspec.shards' layout) read off the target along the given answers;
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
                        feature_layers: list[int] = (), answers_by: str | Path | None = None) -> list[Path]:
    """Rebuild the training shard of every answer file (the first max_files only, when set)
    that has none, or an older one (the target is loaded only if there is any); returns the
    shards written. context_rows: how many prompt rows before each answer to keep too;
    feature_layers: target layers whose input states to keep at every row too; answers_by:
    the model folder that wrote the answers, where it is not model_dir (a student's pass
    along its teacher's answers)."""
    from vllm_mtpspec.checkpoint import model_fingerprint
    from vllm_mtpspec.target import load_target

    todo = [(int(f.stem.split("-")[1]), f) for f in list_answer_files(answers_dir)[:max_files]]
    todo = [(i, f) for i, f in todo if not _newer(shard_path(out_dir, i), f)]
    if not todo:
        return []
    target = load_target(str(model_dir), dtype="fp32")
    fingerprint = model_fingerprint(answers_by or target.model_dir)
    vocab_size = target.model.config.vocab_size
    written, done_tokens, started = [], 0, time.perf_counter()
    bar = tqdm(todo, desc="shards from answers", unit="shard")
    for index, path in bar:
        kept = read_answers(path, fingerprint=fingerprint, vocab_size=vocab_size)
        if kept["meta"].get("labels") == "target":
            # A shard's labels are its answer tokens; human text must be labelled by the target.
            raise AnswersError(f"{path}: field 'labels' is 'target' (human-written text, labelled with the target's "
                               "top-1 by the training job's online path only); train on it with data_source "
                               "'online', or give answers the target generated")
        shard = shard_from_answers(target, kept["ids"], kept["categories"], kept["prompt_ids"], kept["answers"],
                                   top_k=top_k, context_rows=context_rows, feature_layers=feature_layers)
        written.append(write_shard(out_dir, index, shard))
        done_tokens += int(shard["tokens"].numel())
        bar.set_postfix(tokens=done_tokens, tok_per_s=f"{done_tokens / (time.perf_counter() - started):.0f}")
    logger.info("rebuilt %d shards (%d answer tokens) from %s into %s", len(todo), done_tokens, answers_dir, out_dir)
    return written
