"""Calibration inputs for quantizing heads: rows of self-distillation shards (the
target's hidden states and the tokens they produced), the heads' own inputs; for an
attention draft block, whole answers with the prompt rows before them."""
from __future__ import annotations

from pathlib import Path

import torch

from vllm_mtpspec.heads import MTPHeads
from vllm_mtpspec.models import resolve_model
from vllm_mtpspec.sequential_heads import chain_tokens
from vllm_mtpspec.shards import answer_sequence, has_context_rows, list_shards, unroll_sequences


def shard_files(shards_dir: str | Path) -> list[Path]:
    from vllm_mtpspec.quant import QuantError

    files = list_shards(shards_dir)
    if not files:
        raise QuantError(f"--calibration {shards_dir}: holds no shard-*.pt files (training shards are written "
                         "by the training job or by python -m vllm_mtpspec_train.data)")
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
            elif heads.config.kind.reads_drafted_tokens:  # every depth's token, along chains that are right
                chains = tokens if tokens.dim() == 2 else chain_tokens(tokens, heads.num_heads)
                yield hidden, embed[chains.long()]
            else:
                yield hidden, embed[tokens.long()]

    return input_statistics(heads.float(), batches(), lm_head=lambda x: x @ lm_head.T)


@torch.inference_mode()
def block_statistics_from_shards(block, files: list[Path], max_rows: int, *, embed: torch.Tensor,
                                 read: list[Path]):
    """(input statistics of every matrix of an attention draft block, answer rows read):
    each answer of the shards is read with the prompt rows before it, as drafting reads
    it (every row's context entry, then each answer row's chain along the answer's own
    tokens), until max_rows answer rows. The files opened are appended to `read`."""
    from vllm_mtpspec.heads_quant import recorded_inputs
    from vllm_mtpspec.quant import QuantError

    rows = 0
    with recorded_inputs(block) as stats:
        for file in files:
            if rows >= max_rows:
                break
            shard = torch.load(file, weights_only=True)
            read.append(file)
            if not has_context_rows(shard):
                layers = block.feature_layers
                raise QuantError(f"--calibration {file}: an attention draft block is calibrated on answers read with "
                                 "the prompt rows before them, and this shard keeps none (context_hidden): build "
                                 "shards with `python -m vllm_mtpspec_train.data --context-rows 512"
                                 + (f" --feature-layers {','.join(map(str, layers))}" if layers else "") + "`")
            for j in range(len(shard["offsets"]) - 1):
                if rows >= max_rows:
                    break
                seq = answer_sequence(shard, j, block.feature_layers)
                answer_rows = torch.arange(seq["first_answer_row"], seq["tokens"].numel())[None]
                unroll_sequences(block, [seq], embed, query_rows=answer_rows)
                rows += answer_rows.shape[1]
    return stats, rows


def heads_statistics_from_shards(heads: MTPHeads, shards_dir: str | Path, *, model: str, max_rows: int):
    """(input statistics per matrix, a description of the data for the heads config)."""
    from vllm_mtpspec.quant import QuantError
    from vllm_mtpspec.weights import embedding_and_lm_head

    files = shard_files(shards_dir)
    embed, lm_head = embedding_and_lm_head(resolve_model(model, dtype="fp32"))
    if embed.shape[1] != heads.config.hidden_size:
        raise QuantError(f"--model {model}: hidden size {embed.shape[1]}, the heads' is {heads.config.hidden_size}")
    read = []
    if heads.config.kind.keeps_context:
        stats, rows = block_statistics_from_shards(heads.float(), files, max_rows, embed=embed, read=read)
        return stats, f"{rows} answer rows (with their context) of {Path(shards_dir).name}/{read[0].name}..{read[-1].name}"
    rows = [0]

    def counted():
        for hidden, tokens in shard_rows(files, max_rows, read):
            rows[0] += hidden.shape[0]
            yield hidden, tokens

    stats = statistics_from_rows(heads, counted(), embed=embed, lm_head=lm_head)
    return stats, f"{rows[0]} rows of {Path(shards_dir).name}/{read[0].name}..{read[-1].name}"
