"""The online data path of the training job (`data_source: "online"`): drafters trained post-hoc
straight from the answer files, with no shards on disk.

Shards cost 1-5 KB a row; for a draft block's answers with their prompt rows and three layers'
states they run to hours of CPU time and tens of GB. Instead each worker (Ray Train's, or a
local run's) reads its share of the answers, and one batched teacher-forced pass of the frozen
target records each kept row's final state (and the states entering block.feature_layers), the
token it produced and, at answer rows, the target's top-k, in the worker's memory (a GPU's, with
--use-gpu). The block then trains on whole answers read with up to `context_rows` prompt rows
before each, every depth unrolled as drafting runs it (DraftBlock.unrolled): the same examples
and losses as the shard path's BlockModule (tests/test_online_data.py checks that).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from tqdm import tqdm

from vllm_mtpspec.answers import list_answer_files, read_answers
from vllm_mtpspec.layer_states import recording_layer_inputs, stored_layer_states
from vllm_mtpspec_train.losses import mtp_losses


def seed_of(*parts: int) -> int:
    """One seed for a (run seed, rank, epoch or step) tuple: distinct tuples never collide, so
    that a batch order or a step's negatives depend on nothing but their place in the run."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1, dtype=np.uint64)[0])


class TrainingAnswer(NamedTuple):
    prompt: list[int]
    answer: list[int]
    # The answer is human-written text (answer files with meta labels "target"): its labels
    # are the target's top-1 at each row, not its own next tokens.
    labels_from_target: bool = False


@dataclass
class RowStore:
    """Every kept row of a set of answers, packed: answer a's rows are start[a] ..
    start[a] + context[a] - 1 (prompt rows, the last `context_rows` before the answer) then
    length[a] answer rows. Row p's token is the one that follows its state in the text (s_{p+1});
    its label is what the drafter learns to predict there: the same token in the target's own
    answers, the target's top-1 in human-written text."""
    features: torch.Tensor              # [R, d] fp16, the target's final (normed) state
    layer_features: torch.Tensor | None  # [R, n, d] bf16, the states entering feature_layers
    tokens: torch.Tensor                # [R] long
    labels: torch.Tensor                # [R] long
    positions: torch.Tensor             # [R] long, the row's place in prompt + answer
    topk_ids: torch.Tensor              # [R, K] int32 (-1 outside answers)
    topk_logprobs: torch.Tensor         # [R, K] fp16
    start: torch.Tensor                 # [A] long, on the store's device
    context: list[int]                  # [A] on the host: batching reads them
    length: list[int]

    @property
    def num_answers(self) -> int:
        return len(self.context)


def read_answer_dirs(dirs: list[str], *, fingerprint: str | None, vocab_size: int,
                     files_per_dir: list[int | None] | None = None) -> list[TrainingAnswer]:
    """Every answer in the folders' answer files (the first files_per_dir[i] of folder i,
    None: all), in order."""
    pairs: list[TrainingAnswer] = []
    for folder, count in zip(dirs, files_per_dir or [None] * len(dirs)):
        files = list_answer_files(folder)[:count]
        if not files:
            raise FileNotFoundError(f"{folder}: no answer files (answers-*.npz); pass folders that "
                                    "`python -m vllm_mtpspec_train.data --answers-only` wrote (the committed "
                                    "training answers come back with `bash scripts/restore_answers.sh`)")
        for path in files:
            kept = read_answers(path, fingerprint=fingerprint, vocab_size=vocab_size)
            from_target = kept["meta"].get("labels", "answer") == "target"
            pairs += [TrainingAnswer(p, a, from_target) for p, a in zip(kept["prompt_ids"], kept["answers"])
                      if len(a) >= 2 and len(p) >= 1]
    return pairs


def length_batches(lengths: list[int], batch_tokens: int, order: list[int]) -> list[list[int]]:
    """Consecutive items of `order` grouped while (items x the longest) stays within batch_tokens."""
    batches, current, longest = [], [], 0
    for i in order:
        longest_if = max(longest, lengths[i])
        if current and longest_if * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest_if = [], lengths[i]
        current.append(i)
        longest = longest_if
    if current:
        batches.append(current)
    return batches


@torch.inference_mode()
def record_rows(model, pairs, *, context_rows: int, feature_layers: list[int], top_k: int, batch_tokens: int,
                device: torch.device, progress: bool = True) -> RowStore:
    """The frozen target read along every (prompt, answer): right-padded batches of similar
    length, one pass each. Row states are what vllm_mtpspec_train.answers.teacher_forced records.
    pairs: TrainingAnswer, or (prompt, answer) tuples of the target's own answers."""
    pairs = [TrainingAnswer(*pair) for pair in pairs]
    decoder = model.get_decoder()
    lm_head = model.get_output_embeddings().weight
    d = lm_head.shape[1]
    context = [min(context_rows, len(pair.prompt) - 1) for pair in pairs]
    length = [len(pair.answer) for pair in pairs]
    kept = [c + n for c, n in zip(context, length)]
    start = [0]
    for n in kept:
        start.append(start[-1] + n)
    total = start[-1]
    store = RowStore(
        features=torch.empty(total, d, dtype=torch.float16, device=device),
        layer_features=(torch.empty(total, len(feature_layers), d, dtype=torch.bfloat16, device=device)
                        if feature_layers else None),
        tokens=torch.empty(total, dtype=torch.long, device=device),
        labels=torch.empty(total, dtype=torch.long, device=device),
        positions=torch.empty(total, dtype=torch.long, device=device),
        topk_ids=torch.full((total, top_k), -1, dtype=torch.int32, device=device),
        topk_logprobs=torch.full((total, top_k), float("-inf"), dtype=torch.float16, device=device),
        start=torch.tensor(start[:-1], dtype=torch.long, device=device), context=context, length=length)
    full = [len(pair.prompt) + len(pair.answer) for pair in pairs]
    order = sorted(range(len(pairs)), key=lambda i: full[i])
    bar = tqdm(total=sum(full), desc="target states", unit="tok", unit_scale=True, mininterval=5,
               disable=not progress)
    for batch in length_batches(full, batch_tokens, order):
        width = max(full[i] for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for b, i in enumerate(batch):
            ids[b, :full[i]] = torch.tensor(pairs[i][0] + pairs[i][1])
            mask[b, :full[i]] = 1
        ids, mask = ids.to(device), mask.to(device)
        with recording_layer_inputs(decoder, feature_layers, whole_batch=True) as entering:
            states = decoder(input_ids=ids, attention_mask=mask).last_hidden_state
        for b, i in enumerate(batch):
            first = len(pairs[i][0]) - 1                      # the row behind answer token 0
            rows = slice(first - context[i], first + length[i])
            out = slice(start[i], start[i] + kept[i])
            store.features[out] = states[b, rows].half()
            if feature_layers:
                store.layer_features[out] = stored_layer_states(
                    torch.stack([entering[layer][b, rows] for layer in feature_layers], 1))
            store.tokens[out] = ids[b, rows.start + 1:rows.stop + 1]
            store.positions[out] = torch.arange(rows.start, rows.stop, device=device)
            answer_rows = slice(start[i] + context[i], start[i] + kept[i])
            logprobs = torch.log_softmax((states[b, first:first + length[i]] @ lm_head.T).float(), -1)
            top_lp, top_ids = logprobs.topk(top_k, dim=-1)
            store.topk_ids[answer_rows], store.topk_logprobs[answer_rows] = top_ids.int(), top_lp.half()
            store.labels[out] = store.tokens[out]
            if pairs[i].labels_from_target:
                store.labels[answer_rows] = top_ids[:, 0]
        bar.update(sum(full[i] for i in batch))
    bar.close()
    return store


def record_share(model_dir, answer_dirs: list[str], *, rank: int, world_size: int, context_rows: int,
                 feature_layers: list[int], top_k: int, batch_tokens: int, device: torch.device,
                 files_per_dir: list[int | None] | None = None) -> RowStore:
    """A worker's share of the answers (every world_size-th, from rank on: each worker gets some
    of every folder), recorded by the frozen target on `device`; the target is let go after."""
    from transformers import AutoModelForCausalLM

    from vllm_mtpspec.checkpoint import model_fingerprint

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                 attn_implementation="sdpa").to(device).eval()
    pairs = read_answer_dirs(answer_dirs, fingerprint=model_fingerprint(model_dir), vocab_size=model.config.vocab_size,
                             files_per_dir=files_per_dir)[rank::world_size]
    if not pairs:
        raise ValueError(f"train_answers hold fewer answers than the {world_size} workers: worker {rank} has none; "
                         "use fewer workers (num_workers) or more answers")
    if device.type == "cuda":
        # TF32 for the target's pass: its states move by about what their fp16 storage rounds
        # off, and the pass runs several times faster than in full fp32.
        torch.backends.cuda.matmul.allow_tf32 = True
    return record_rows(model, pairs, context_rows=context_rows, feature_layers=feature_layers, top_k=top_k,
                       batch_tokens=batch_tokens, device=device, progress=rank == 0)


def epoch_batches(store: RowStore, *, batch_rows: int, seed: int) -> list[list[int]]:
    """One pass over the store's answers: batches of near-equal lengths (sorted by a jittered
    length, so they differ from epoch to epoch) in a shuffled order. `seed` fixes both: a run
    repeats step for step, and a resumed one finds the batch it stopped at."""
    rng = random.Random(seed)
    lengths = [c + n for c, n in zip(store.context, store.length)]
    order = sorted(range(store.num_answers), key=lambda a: lengths[a] * (1 + 0.2 * rng.random()))
    batches = length_batches(lengths, batch_rows, order)
    rng.shuffle(batches)
    return batches


def batch_examples(store: RowStore, answers: list[int], depth: int) -> dict[str, torch.Tensor]:
    """Answers as one right-padded batch for DraftBlock.unrolled, with the answers' rows as
    query_rows and the loss rows among them: every answer row that has a next token, its
    targets at depths 1..depth (the labels of the answer's rows 1..depth ahead, -1 past its end) and the
    target's top-k there (what vllm_mtpspec_train.examples gives the Ray job's BlockModule)."""
    device = store.features.device
    n = torch.tensor([store.context[a] + store.length[a] for a in answers], device=device)
    t = max(store.context[a] + store.length[a] for a in answers)
    q = max(store.length[a] for a in answers)
    start = store.start[torch.tensor(answers, device=device)]
    context = torch.tensor([store.context[a] for a in answers], device=device)
    length = torch.tensor([store.length[a] for a in answers], device=device)
    cols = torch.arange(t + depth - 1, device=device)
    rows = start[:, None] + cols                                              # [B, T + depth - 1]
    inside = cols < n[:, None]
    rows = torch.where(inside, rows, 0)
    valid = inside[:, :t]
    answer_row = torch.arange(q, device=device)                               # [Q]: r, the answer's row
    batch = {
        "features": store.features[rows[:, :t]].float(),
        "tokens": torch.where(inside, store.tokens[rows], 0),
        "positions": torch.where(valid, store.positions[rows[:, :t]], 0),
        "valid": valid,
        "query_rows": (context[:, None] + answer_row).clamp_max(t - 1),       # [B, Q]
    }
    if store.layer_features is not None:
        batch["layer_features"] = store.layer_features[rows[:, :t]].float()
    loss_b, loss_r = torch.nonzero(answer_row < length[:, None] - 1, as_tuple=True)
    batch.update(loss_b=loss_b, loss_r=loss_r,
                 **_ahead(store, start[loss_b] + context[loss_b] + loss_r, length[loss_b] - loss_r, depth))
    return batch


def row_examples(store: RowStore, answers: list[int], depth: int) -> dict[str, torch.Tensor]:
    """The answers' rows as parallel or sequential heads read them (the columns of
    vllm_mtpspec_train.examples.shard_examples): every answer row that has a next token, with
    the target's state there, the token it produced, and the labels and top-k 1..depth rows on."""
    device = store.features.device
    index = torch.tensor(answers, device=device)
    first = store.start[index] + torch.tensor([store.context[a] for a in answers], device=device)
    length = torch.tensor([store.length[a] for a in answers], device=device)
    longest = max(store.length[a] for a in answers)
    which, r = torch.nonzero(torch.arange(longest, device=device) < length[:, None] - 1, as_tuple=True)
    rows = first[which] + r
    return {"hidden": store.features[rows].float(), "token": store.tokens[rows],
            **_ahead(store, rows, length[which] - r, depth)}


def _ahead(store: RowStore, rows: torch.Tensor, left: torch.Tensor, depth: int) -> dict[str, torch.Tensor]:
    """For answer rows (left: rows to the answer's end, this one included), the labels at
    depths 1..depth (-1 past the answer's end) and the target's top-k there."""
    ahead = torch.arange(1, depth + 1, device=rows.device)
    has = ahead < left[:, None]                                               # [R, depth]
    target_rows = torch.where(has, rows[:, None] + ahead, 0)
    return {"targets": torch.where(has, store.labels[target_rows], -1),
            "teacher_ids": torch.where(has[..., None], store.topk_ids[target_rows], -1),
            "teacher_logprobs": torch.where(has[..., None], store.topk_logprobs[target_rows].float(), float("-inf"))}


def unrolled_states(block, batch: dict, embed: torch.Tensor) -> torch.Tensor:
    """[B, Q, k, d]: the chains of the batch's query rows (vllm_mtpspec.shards.unroll_sequences,
    at the answers' rows only)."""
    t = batch["features"].shape[1]
    token_embeds = [embed[batch["tokens"][:, i:i + t]] for i in range(block.num_heads)]
    return torch.stack(block.unrolled(batch["features"], token_embeds, batch["positions"], batch["valid"],
                                      batch.get("layer_features"), query_rows=batch["query_rows"]), 2)


def batch_loss(block, batch: dict, *, embed, lm_head, num_negatives: int, kl_weight: float, depth_decay: float,
               generator=None):
    states = unrolled_states(block, batch, embed)
    return mtp_losses(block.projection_input(states[batch["loss_b"], batch["loss_r"]]), lm_head, batch["targets"], batch["teacher_ids"],
                      batch["teacher_logprobs"], num_negatives=num_negatives, kl_weight=kl_weight,
                      depth_decay=depth_decay, generator=generator)


