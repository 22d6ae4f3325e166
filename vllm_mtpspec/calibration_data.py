"""Calibration inputs for quantizing heads: rows of self-distillation shards (the
target's hidden states and the tokens they produced), the heads' own inputs."""
from __future__ import annotations

from pathlib import Path

import torch

from vllm_mtpspec.heads import MTPHeads
from vllm_mtpspec.sequential_heads import chain_tokens


def shard_files(shards_dir: str | Path) -> list[Path]:
    from vllm_mtpspec.quant import QuantError

    files = sorted(Path(shards_dir).glob("shard-*.pt"))
    if not files:
        raise QuantError(f"--calibration {shards_dir}: holds no shard-*.pt files (training shards are written "
                         "by the training job or by python -m training.data)")
    return files


def shard_rows(files: list[Path], max_rows: int, read: list[Path] | None = None):
    """(hidden [n, d], tokens [n]) chunks from the shards, in order, max_rows in all; the
    files it opened are appended to `read`."""
    left = max_rows
    for file in files:
        if left <= 0:
            return
        shard = torch.load(file, weights_only=True)
        if read is not None:
            read.append(file)
        hidden, tokens = shard["hidden"][:left], shard["tokens"][:left]
        for start in range(0, hidden.shape[0], 1024):
            yield hidden[start:start + 1024], tokens[start:start + 1024]
        left -= hidden.shape[0]


def statistics_from_rows(heads: MTPHeads, chunks, *, embed: torch.Tensor, lm_head: torch.Tensor):
    """Input statistics of every head matrix from (hidden [n, d], tokens [n]) chunks: the
    tokens' embeddings feed token-conditioned heads, lm_head [V, d] untied projections.
    Sequential heads read each depth's token: tokens [n, k] gives them, tokens [n] has the
    chunk's following tokens stand in (a chunk may end or cross an answer's end: a few rows
    of inexact statistics, never a wrong draft)."""
    from vllm_mtpspec.heads_quant import input_statistics

    def batches():
        for hidden, tokens in chunks:
            if not heads.config.token_conditioned:
                yield hidden, None
            elif heads.config.head_kind == "sequential":  # every depth's token, along chains that are right
                chains = tokens if tokens.dim() == 2 else chain_tokens(tokens, heads.num_heads)
                yield hidden, embed[chains.long()]
            else:
                yield hidden, embed[tokens.long()]

    return input_statistics(heads.float(), batches(), lm_head=lambda x: x @ lm_head.T)


def heads_statistics_from_shards(heads: MTPHeads, shards_dir: str | Path, *, model: str, max_rows: int):
    """(input statistics per matrix, a description of the data for the heads config)."""
    from vllm_mtpspec.models import resolve_model
    from vllm_mtpspec.quant import QuantError
    from vllm_mtpspec.weights import embedding_and_lm_head

    files = shard_files(shards_dir)
    embed, lm_head = embedding_and_lm_head(resolve_model(model, dtype="fp32"))
    if embed.shape[1] != heads.config.hidden_size:
        raise QuantError(f"--model {model}: hidden size {embed.shape[1]}, the heads' is {heads.config.hidden_size}")
    rows, read = [0], []

    def counted():
        for hidden, tokens in shard_rows(files, max_rows, read):
            rows[0] += hidden.shape[0]
            yield hidden, tokens

    stats = statistics_from_rows(heads, counted(), embed=embed, lm_head=lm_head)
    return stats, f"{rows[0]} rows of {Path(shards_dir).name}/{read[0].name}..{read[-1].name}"
