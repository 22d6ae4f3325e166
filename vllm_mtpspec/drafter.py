"""Drafters: what turns the target's last hidden state into per-head candidate logits.

The reference decoder (and anything else that drafts outside vLLM) talks to a drafter
through one call, so tests can plug in an oracle that knows the target's future.
"""
from __future__ import annotations

from typing import Protocol

import torch

from vllm_mtpspec.heads import MTPHeads


class Drafter(Protocol):
    num_heads: int

    def head_logits(self, hidden: torch.Tensor, root_tokens: torch.Tensor) -> torch.Tensor:
        """hidden [B, d]: the state that produced root_tokens [B] -> logits [B, k, V]."""


class HeadsDrafter:
    """MTP heads over a Hugging Face causal LM (its embedding and LM head)."""

    def __init__(self, heads: MTPHeads, model) -> None:
        self.heads = heads
        self.num_heads = heads.num_heads
        self._embed = model.get_input_embeddings()
        self._lm_head = model.get_output_embeddings()
        if heads.draft_vocab is not None:
            self._lm_head = heads.lm_head_for(self._lm_head.weight.detach())
        self.temperatures = heads.temperatures

    @torch.no_grad()
    def head_logits(self, hidden: torch.Tensor, root_tokens: torch.Tensor) -> torch.Tensor:
        embeds = self._embed(root_tokens) if self.heads.config.token_conditioned else None
        return self.heads.target_vocab_logits(self.heads(hidden, token_embeds=embeds, lm_head=self._lm_head))
