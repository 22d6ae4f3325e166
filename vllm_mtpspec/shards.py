"""Training shards: the files the training job writes (vllm_mtpspec_train.data) and the
library reads too (`mtpspec heads quantize --calibration`), and how a draft block reads an
answer of one with the prompt rows before it (what training, the held-out scorer and
calibration share).

Shard layout (torch.save), for n answers of lengths L_j, N = sum L_j:
  ids, categories: [n] str;  prompt_ids: [n] list[int];  offsets: [n + 1] (into rows)
  tokens [N] int32        answer tokens, row r of answer j is its token r - offsets[j]
  hidden [N, d] fp16      the hidden state that produced tokens[r]
  topk_ids [N, K] int32, topk_logprobs [N, K] fp16: the target's distribution for tokens[r]
With context rows (draft modules that attend over the prompt), for C_j kept prompt rows:
  context_offsets [n + 1]; context_hidden [sum C_j, d] fp16: the states at the last C_j
  prompt positions before answer j's first row; the state at prompt position p predicts
  prompt token p + 1, so the tokens beside them are prompt_ids[j][P_j - C_j:]
With feature layers (draft blocks that read lower layers too, EAGLE-3), for n layers:
  feature_layers [n] int64; layer_hidden [N, n, d] fp16 and context_layer_hidden
  [sum C_j, n, d] fp16: the states entering those target layers at the same rows
"""
from __future__ import annotations

from pathlib import Path

import torch


class ShardsError(ValueError):
    """Shards that cannot serve what was asked of them; the message says how to rebuild them."""


# Prompt rows kept before each answer for draft modules that attend over the context.
CONTEXT_ROWS = 512


def shard_path(out_dir: str | Path, index: int) -> Path:
    return Path(out_dir) / f"shard-{index:05d}.pt"


def list_shards(out_dir: str | Path) -> list[Path]:
    return sorted(Path(out_dir).glob("shard-*.pt"))


def write_shard(out_dir: str | Path, index: int, shard: dict) -> Path:
    """Written whole or not at all."""
    path = shard_path(out_dir, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    torch.save(shard, tmp)
    tmp.rename(path)
    return path


def has_context_rows(shard: dict) -> bool:
    return "context_hidden" in shard


def layer_columns(shard: dict, feature_layers, where: str = "these shards") -> list[int]:
    """Where each of feature_layers sits in the shard's layer_hidden; refused when the
    shards did not keep one of them."""
    kept = shard["feature_layers"].tolist() if "feature_layers" in shard else []
    missing = [layer for layer in feature_layers if layer not in kept]
    if missing:
        raise ShardsError(f"{where} keep the states entering target layers {kept or 'none'}, and the draft block "
                          f"reads layers {list(feature_layers)} (block.feature_layers): rebuild them with "
                          f"`python -m vllm_mtpspec_train.data --context-rows {CONTEXT_ROWS} --feature-layers "
                          f"{','.join(map(str, feature_layers))}` into a new folder")
    return [kept.index(layer) for layer in feature_layers]


def answer_sequence(shard: dict, j: int, feature_layers=()) -> dict[str, torch.Tensor]:
    """Answer j with the prompt rows before it, as an attention draft block reads them.

    features [T, d]: the kept context rows, then the answer rows; tokens [T]: the token
    each row produced (the next prompt token, then the answer's own); positions [T]: the
    rows' places in prompt + answer; first_answer_row: where the answer's rows begin;
    with feature_layers, layer_features [T, n, d]: the states entering those layers."""
    start, end = int(shard["offsets"][j]), int(shard["offsets"][j + 1])
    prompt = list(shard["prompt_ids"][j])
    answer = shard["tokens"][start:end].long()
    if has_context_rows(shard):
        c0, c1 = int(shard["context_offsets"][j]), int(shard["context_offsets"][j + 1])
        context = shard["context_hidden"][c0:c1]
    else:
        context = shard["hidden"][:0]
    c = context.shape[0]
    first = len(prompt) - 1  # the prompt position of answer row 0
    tokens = torch.cat([torch.tensor(prompt[len(prompt) - c:], dtype=torch.long), answer])
    sequence = {
        "features": torch.cat([context.float(), shard["hidden"][start:end].float()]),
        "tokens": tokens,
        "positions": torch.arange(first - c, first + end - start),
        "first_answer_row": c,
    }
    if feature_layers:
        columns = layer_columns(shard, feature_layers)
        answer_layers = shard["layer_hidden"][start:end, columns]
        context_layers = shard["context_layer_hidden"][c0:c1, columns] if c else answer_layers[:0]
        sequence["layer_features"] = torch.cat([context_layers.float(), answer_layers.float()])
    return sequence


def unroll_sequences(block, seqs: list[dict], embed: torch.Tensor, query_rows: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """answer_sequence()s through DraftBlock.unrolled: [B, T, k, d], every position's
    chain (what training and the held-out scorer both read); with query_rows [B, Q], the
    chains of those rows only, [B, Q, k, d]."""
    device = embed.device
    batch = {key: value.to(device) for key, value in pad_sequences(seqs, depth=block.num_heads).items()}
    t = batch["features"].shape[1]
    token_embeds = [embed[batch["tokens"][:, i:i + t]] for i in range(block.num_heads)]  # depth i + 1 reads s_{p+i+1}
    return torch.stack(block.unrolled(batch["features"].float(), token_embeds, batch["positions"], batch["valid"],
                                      batch.get("layer_features"),
                                      None if query_rows is None else query_rows.to(device)), 2)


def pad_sequences(seqs: list[dict], *, depth: int) -> dict[str, torch.Tensor]:
    """answer_sequence()s -> right-padded [B, T] batches; tokens get depth - 1 more columns
    so that every depth's token (s_{p+j}) can be read at every position (0 past the end,
    where no loss looks)."""
    t = max(s["tokens"].numel() for s in seqs)
    d = seqs[0]["features"].shape[1]
    features = torch.zeros(len(seqs), t, d, dtype=seqs[0]["features"].dtype)
    tokens = torch.zeros(len(seqs), t + depth - 1, dtype=torch.long)
    positions = torch.zeros(len(seqs), t, dtype=torch.long)
    valid = torch.zeros(len(seqs), t, dtype=torch.bool)
    for b, s in enumerate(seqs):
        n = s["tokens"].numel()
        features[b, :n], tokens[b, :n], positions[b, :n], valid[b, :n] = s["features"], s["tokens"], s["positions"], True
    batch = {"features": features, "tokens": tokens, "positions": positions, "valid": valid}
    if "layer_features" in seqs[0]:
        layers = torch.zeros(len(seqs), t, *seqs[0]["layer_features"].shape[1:], dtype=features.dtype)
        for b, s in enumerate(seqs):
            layers[b, :s["tokens"].numel()] = s["layer_features"]
        batch["layer_features"] = layers
    return batch
