"""Drafters: what turns the target's last hidden state into per-head candidate logits.

The reference decoder (and anything else that drafts outside vLLM) talks to a drafter
through one call, so tests can plug in an oracle that knows the target's future. A
drafter that reads the context (an attention draft block) also has `start` (a new
sequence) and `observe` (the states of accepted positions and the tokens they produced).
"""
from __future__ import annotations

from typing import Protocol

import torch

from vllm_mtpspec.heads import DraftModule, MTPHeads
from vllm_mtpspec.layer_states import split_layer_states


class Drafter(Protocol):
    num_heads: int

    def head_logits(self, hidden: torch.Tensor, root_tokens: torch.Tensor) -> torch.Tensor:
        """hidden [B, d]: the state that produced root_tokens [B] -> logits [B, k, V]."""


class HeadsDrafter:
    """MTP heads (parallel or sequential) over a Hugging Face causal LM (its embedding and
    LM head); sequential heads' deeper logits are those along their own top-1 chain."""

    def __init__(self, heads: MTPHeads, model) -> None:
        self.heads = heads
        self.config = heads.config
        self.num_heads = heads.num_heads
        self._embed = model.get_input_embeddings()
        self._lm_head = model.get_output_embeddings()
        if heads.draft_vocab is not None:
            self._lm_head = heads.lm_head_for(self._lm_head.weight.detach())
        self.temperatures = heads.temperatures

    @property
    def grows_trees(self) -> bool:
        """Whether its dynamic trees are grown from draft_step (grown_tree.py)."""
        return self.heads.config.kind.grows_trees

    @property
    def draft_ids(self) -> torch.Tensor | None:
        return self.heads.draft_vocab

    def draft_step(self):
        """The per-depth draft step of a grown tree (sequential heads)."""
        return self.heads.draft_step(self._lm_head, self._embed, self.temperatures)

    @torch.no_grad()
    def head_logits(self, hidden: torch.Tensor, root_tokens: torch.Tensor) -> torch.Tensor:
        embeds = self._embed(root_tokens) if self.heads.config.token_conditioned else None
        logits = self.heads.draft_logits(hidden, embeds, self.num_heads, self._lm_head, self._embed,
                                         self.heads.draft_vocab)
        return self.heads.target_vocab_logits(logits)


class BlockDrafter:
    """An attention draft block over a Hugging Face causal LM, one sequence at a time: its
    cache holds the entries of accepted positions; each draft runs the block depth by
    depth along its own top-1 chain (deeper logits are those of that chain), or grows a
    dynamic tree (draft_step)."""

    def __init__(self, block, model) -> None:
        self.block = block
        self.config = block.config
        self.num_heads = block.num_heads
        # The rows it is given carry the states entering these layers too (layer_states.py).
        self.feature_layers = block.feature_layers
        self.temperatures = block.temperatures
        self._embed = model.get_input_embeddings()
        self._project = block.lm_head_for(model.get_output_embeddings().weight.detach())
        self.cache = None

    def start(self) -> None:
        self.cache = self.block.empty_cache()

    @property
    def grows_trees(self) -> bool:
        """Whether its dynamic trees are grown from draft_step (grown_tree.py)."""
        return self.config.kind.grows_trees

    @property
    def draft_ids(self) -> torch.Tensor | None:
        return self.block.draft_vocab

    def draft_step(self):
        """The per-depth draft step of a grown tree: step 0 is given the root's row (the
        state that produced the root token, and the root), which enters the cache as it
        does before a chain; deeper steps are the block's (DraftBlock.tree_step)."""
        grown = None

        def step(i: int, states: torch.Tensor, tokens: torch.Tensor):
            nonlocal grown
            if i == 0:
                newest = self._extend(states, tokens)[-1:]
                self.block.trim(self.cache)
                grown = self.block.tree_step([self.cache], self._project, self._embed, self.temperatures,
                                             self.block.draft_vocab)
                states = newest
            return grown(i, states, tokens)

        return step

    def _extend(self, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        states, layers = split_layer_states(rows, self.block.config.hidden_size)
        return self.block.extend(self.cache, states, self._embed(tokens), layers)

    @torch.no_grad()
    def observe(self, states: torch.Tensor, tokens: torch.Tensor) -> None:
        """states [n, d] (or rows with layer states, [n, (1 + n_layers) d]) of accepted
        positions and the tokens [n] each produced."""
        if tokens.numel():
            self._extend(states, tokens)
            self.block.trim(self.cache)

    @torch.no_grad()
    def head_logits(self, hidden: torch.Tensor, root_tokens: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] != 1:
            raise ValueError(f"BlockDrafter drafts for one sequence at a time, got a batch of {hidden.shape[0]}")
        newest = self._extend(hidden, root_tokens)[-1:]
        self.block.trim(self.cache)
        logits = self.block.draft_chains([self.cache], newest, self.num_heads, self._project, self._embed,
                                         self.block.draft_vocab)
        return self.block.target_vocab_logits(logits)


def drafter_for(heads: DraftModule, model) -> "HeadsDrafter | BlockDrafter":
    """The drafter for a head kind."""
    return heads.config.kind.drafter(heads, model)
