"""What an attention draft block remembers per request while vLLM serves: the cache of its
entries for accepted positions, fed every step from the hidden states vLLM computed for
every scheduled token (prefill chunks included).

Row layout, per request in the input batch's order: its scheduled tokens at positions
num_computed .. num_computed + n - 1. Row r's state produced the token at position
num_computed + r + 1, which is known (the prompt, or a token sampled this step) for the
first num_tokens_no_spec - 1 - num_computed rows; the rest are rejected drafts and leave
nothing. So after a decode step with a accepted drafts, rows 0..a enter the cache; after
a prefill chunk, all its rows.

The cache must end where this step's tokens begin. Where it does not, vLLM computed some
positions without us seeing them or computes them again:
- it ends later (preemption recomputes a request, or a resumed request): cut it back;
- it ends earlier (a prefix-cache hit skipped the shared prefix): start again at this
  step's first position, so the block drafts from the context it did see. Output stays
  exactly the target's either way; only acceptance can fall.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_mtpspec.draft_block import BlockCache, DraftBlock


@dataclass
class ScheduledRows:
    hidden_states: torch.Tensor      # [>= total scheduled tokens, d], requests' rows in batch order
    num_scheduled: list[int]         # per request in the batch
    num_computed: list[int]          # per request: its position of this step's first token
    # The states entering the block's feature layers at the same rows (vLLM's
    # aux_hidden_states, ascending layers), where the block reads any.
    layer_states: list[torch.Tensor] | None = None


class BlockContexts:
    def __init__(self, block: DraftBlock, embed) -> None:
        self.block = block
        self._embed = embed
        self.caches: dict[str, BlockCache] = {}

    @torch.no_grad()
    def update(self, req_ids: list[str], rows: ScheduledRows, num_tokens_no_spec, token_ids_cpu) -> dict[int, torch.Tensor]:
        """Feeds this step's accepted rows into each request's cache (all requests in one
        pass of the block); returns, by batch index, the block's output at the request's
        newest position (what drafts from it)."""
        live = set(req_ids)
        self.caches = {r: c for r, c in self.caches.items() if r in live}
        fed, caches, states, produced, layers = [], [], [], [], []
        entering = None
        if self.block.feature_layers:
            if not rows.layer_states or len(rows.layer_states) != len(self.block.feature_layers):
                raise RuntimeError(f"the draft block reads the states entering target layers "
                                   f"{self.block.feature_layers}, and vLLM handed "
                                   f"{len(rows.layer_states or [])} aux_hidden_states this step")
            entering = torch.stack([state[:rows.hidden_states.shape[0]] for state in rows.layer_states], 1)
        offset = 0
        for i, req_id in enumerate(req_ids):
            n, start = int(rows.num_scheduled[i]), int(rows.num_computed[i])
            cache = self._cache_ending_at(req_id, start)
            known = min(n, int(num_tokens_no_spec[i]) - 1 - start)
            if known > 0:
                fed.append(i)
                caches.append(cache)
                states.append(rows.hidden_states[offset:offset + known])
                if entering is not None:
                    layers.append(entering[offset:offset + known])
                produced.append(torch.as_tensor(token_ids_cpu[i, start + 1:start + 1 + known], dtype=torch.long))
            offset += n
        if not fed:
            return {}
        device = rows.hidden_states.device
        embeds = self._embed(torch.cat(produced).to(device)).split([len(t) for t in produced])
        outputs = self.block.extend_many(caches, states, list(embeds), layers if entering is not None else None)
        for cache in caches:
            self.block.trim(cache)
        return {i: out[-1] for i, out in zip(fed, outputs)}

    def _cache_ending_at(self, req_id: str, position: int) -> BlockCache:
        cache = self.caches.get(req_id)
        if cache is None or cache.length < position or position < cache.start:
            cache = self.block.empty_cache()
            cache.start = position
            self.caches[req_id] = cache
        elif cache.length > position:
            self.block.truncate(cache, position)
        return cache

    @torch.no_grad()
    def chain_probs(self, batch_indices: list[int], newest: dict[int, torch.Tensor], req_ids: list[str], depth: int,
                    project, temperatures: torch.Tensor, draft_ids: torch.Tensor | None) -> torch.Tensor:
        """[B, depth, V] temperature-scaled probabilities along each request's own top-1
        chain, all requests drafted together."""
        caches = [self.caches[req_ids[i]] for i in batch_indices]
        logits = self.block.draft_chains(caches, torch.stack([newest[i] for i in batch_indices]), depth, project,
                                         self._embed, draft_ids).float()
        return torch.softmax(logits / temperatures[:depth, None], dim=-1)
