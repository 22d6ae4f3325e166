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


class BlockContexts:
    def __init__(self, block: DraftBlock, embed) -> None:
        self.block = block
        self._embed = embed
        self.caches: dict[str, BlockCache] = {}

    @torch.no_grad()
    def update(self, req_ids: list[str], rows: ScheduledRows, num_tokens_no_spec, token_ids_cpu) -> dict[int, torch.Tensor]:
        """Feeds this step's accepted rows into each request's cache; returns, by batch
        index, the block's output at the request's newest position (what drafts from it)."""
        hidden_states, num_scheduled, num_computed = rows.hidden_states, rows.num_scheduled, rows.num_computed
        live = set(req_ids)
        self.caches = {r: c for r, c in self.caches.items() if r in live}
        newest: dict[int, torch.Tensor] = {}
        offset = 0
        for i, req_id in enumerate(req_ids):
            n, start = int(num_scheduled[i]), int(num_computed[i])
            cache = self._cache_ending_at(req_id, start)
            known = min(n, int(num_tokens_no_spec[i]) - 1 - start)
            if known > 0:
                produced = torch.as_tensor(token_ids_cpu[i, start + 1:start + 1 + known], dtype=torch.long)
                states = hidden_states[offset:offset + known]
                newest[i] = self.block.extend(cache, states, self._embed(produced.to(states.device)))[-1]
            offset += n
        return newest

    def _cache_ending_at(self, req_id: str, position: int) -> BlockCache:
        cache = self.caches.get(req_id)
        if cache is None or cache.length < position or position < cache.start:
            weight = self.block.fuse.weight
            cache = self.block.empty_cache(device=weight.device, dtype=weight.dtype)
            cache.start = position
            self.caches[req_id] = cache
        elif cache.length > position:
            keep = position - cache.start
            cache.keys, cache.values = cache.keys[:, :keep], cache.values[:, :keep]
        return cache

    @torch.no_grad()
    def chain_probs(self, batch_indices: list[int], newest: dict[int, torch.Tensor], req_ids: list[str], depth: int,
                    project, temperatures: torch.Tensor, draft_ids: torch.Tensor | None) -> torch.Tensor:
        """[B, depth, V] temperature-scaled probabilities along each request's own top-1
        chain: depth j reads depth j - 1's output and the token drafted from it."""
        out = []
        for i in batch_indices:
            cache, g, chain, rows = self.caches[req_ids[i]], newest[i], [], []
            for j in range(depth):
                logits = project(g[None]).float()[0]
                rows.append(torch.softmax(logits / temperatures[j], dim=-1))
                if j + 1 < depth:
                    token = logits.argmax()
                    if draft_ids is not None:
                        token = draft_ids[token]
                    g, entry = self.block.draft_step(cache, chain, g, self._embed(token[None])[0])
                    chain.append(entry)
            out.append(torch.stack(rows))
        return torch.stack(out)
