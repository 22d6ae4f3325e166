"""What an attention draft block remembers per request while vLLM serves: the cache of its
entries for accepted positions, fed from the hidden states vLLM computed for every
scheduled token (prefill chunks included).

The rows are taken every step but go through the block only when a draft needs them (or
once a request holds `max_pending_rows` of them). The block is one layer, so an entry's
key and value depend on its own position's inputs alone: running rows late gives the
entries running them at once would. A step where the planner drafts nothing for a
request (most steps of a large batch on a CPU) costs that request a copy of its rows;
running them is counted as the drafting time of the step that needs them, which the
planner weighs against what the drafts add. During a long rest (the draft-size rule has
found, check after check, that the heads do not pay for this kind of batch), held rows
are not run at all: a request past max_pending_rows keeps its latest recent_rows on a
cache restarted there, so that a large batch that drafts nothing pays for row copies only.
Short rests keep the whole context: a check after a few dozen steps must see it to find
the heads paying again.

Row layout, per request in the input batch's order: its scheduled tokens at positions
num_computed .. num_computed + n - 1. Row r's state produced the token at position
num_computed + r + 1, which is known (the prompt, or a token sampled this step) for the
first num_tokens_no_spec - 1 - num_computed rows; the rest are rejected drafts and leave
nothing. So after a decode step with a accepted drafts, rows 0..a enter the cache; after
a prefill chunk, all its rows. A tree step's rows are its root and every node,
breadth-first: there the root's row and the accepted nodes' enter, in path order (each
node was computed at its depth's position, seeing its ancestors only, so its state is
the one the accepted chain would have).

The cache must end where this step's tokens begin. Where it does not, vLLM computed some
positions without us seeing them or computes them again:
- it ends later (preemption recomputes a request, or a resumed request): cut it back;
- it ends earlier (a prefix-cache hit skipped the shared prefix): take the entries an
  earlier request with the same tokens left (context_store.py), or else start again at
  this step's first position, so the block drafts from the context it did see. Output
  stays exactly the target's either way; only acceptance can fall.
A request that leaves the batch (finished, aborted or preempted) leaves its entries to that
store.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_mtpspec.draft_block import BlockCache, DraftBlock
from vllm_mtpspec.host_copy import to_device_without_waiting
from vllm_mtpspec.vllm.context_store import ContextStore


@dataclass
class ScheduledRows:
    hidden_states: torch.Tensor      # [>= total scheduled tokens, d], requests' rows in batch order
    num_scheduled: list[int]         # per request in the batch
    num_computed: list[int]          # per request: its position of this step's first token
    # The states entering the block's feature layers at the same rows (vLLM's
    # aux_hidden_states, ascending layers), where the block reads any.
    layer_states: list[torch.Tensor] | None = None


@dataclass
class PendingRows:
    """A request's rows taken and not yet run through the block, at the positions right
    after its cache's entries."""
    states: list[torch.Tensor] = field(default_factory=list)        # [n, d] each
    tokens: list[torch.Tensor] = field(default_factory=list)        # [n] each: the tokens they produced (host)
    layer_states: list[torch.Tensor] = field(default_factory=list)  # [n, layers, d] each, where the block reads any
    rows: int = 0

    def add(self, states: torch.Tensor, tokens: torch.Tensor, layer_states: torch.Tensor | None) -> None:
        self.states.append(states)
        self.tokens.append(tokens)
        if layer_states is not None:
            self.layer_states.append(layer_states)
        self.rows += states.shape[0]

    def last(self, rows: int) -> "PendingRows":
        """The last `rows` of them, in one copy (views would keep whole steps' rows)."""
        states, tokens, layer_states, skip = [], [], [], self.rows - rows
        for i, own in enumerate(self.states):
            if skip >= own.shape[0]:
                skip -= own.shape[0]
                continue
            states.append(own[skip:])
            tokens.append(self.tokens[i][skip:])
            if self.layer_states:
                layer_states.append(self.layer_states[i][skip:])
            skip = 0
        kept = PendingRows()
        kept.add(torch.cat(states), torch.cat(tokens), torch.cat(layer_states) if layer_states else None)
        return kept

    def first(self, rows: int) -> "PendingRows":
        """The first `rows` of them (the rest are positions vLLM computes again)."""
        kept = PendingRows()
        for i, states in enumerate(self.states):
            take = min(states.shape[0], rows - kept.rows)
            if take <= 0:
                break
            kept.add(states[:take], self.tokens[i][:take],
                     self.layer_states[i][:take] if self.layer_states else None)
        return kept


class BlockContexts:
    # Rows a request holds back at most: beyond them they run through the block even with no
    # draft asking (a prompt's prefill, or a request the planner has not drafted for a while),
    # so that what is held stays small: 64 rows of a block reading three layers are 0.6 MB
    # per request in fp32.
    max_pending_rows = 64
    # A step in which no request took more rows than this (a decode step) is copied once and
    # each request holds a view of that copy; in one where a request took more (a prompt's
    # chunk), each holds a copy of its own, so that a short request's rows do not keep a
    # long prompt's alive.
    max_shared_rows = 16
    # During a long rest, a request that reaches max_pending_rows keeps only its latest rows
    # instead of running them all: resting costs row copies only, and a check during the
    # rest reads the block over this recent context (its drafts may keep less; the output
    # is the target's either way).
    recent_rows = 32

    def __init__(self, block: DraftBlock, embed, store: ContextStore | None = None) -> None:
        self.block = block
        self._embed = embed
        self.store = store
        self.caches: dict[str, BlockCache] = {}
        self.pending: dict[str, PendingRows] = {}
        self.newest: dict[str, torch.Tensor] = {}  # the block's output at a cache's last entry
        # A request's tokens at positions 0 .. (its cache's end + its pending rows): what the
        # store keys its entries by when it leaves.
        self.tokens: dict[str, list[int]] = {}
        # Whether this step is in a long rest (update's long_rest): a request that leaves
        # then has its held rows dropped, not run for the store.
        self.long_rest = False

    def forget(self, req_id: str) -> None:
        self.caches.pop(req_id, None)
        self.pending.pop(req_id, None)
        self.newest.pop(req_id, None)
        self.tokens.pop(req_id, None)

    @torch.inference_mode()  # as vLLM's step runs: the caches are inference tensors
    def leave(self, req_id: str) -> None:
        """The request left the batch (finished, aborted or preempted): its entries go to
        the store, its rows still held back run first (in a long rest, the entries already
        run go alone), and nothing else of it is kept."""
        cache = self.caches.get(req_id)
        if self.store is not None and cache is not None:
            if not self.long_rest:
                self._run_pending([req_id])
            if cache.size:
                self.store.put(self.tokens[req_id][:cache.length + 1], cache)
        self.forget(req_id)

    def held_requests(self) -> set[str]:
        return set(self.caches) | set(self.pending) | set(self.newest) | set(self.tokens)

    @torch.no_grad()
    def update(self, req_ids: list[str], rows: ScheduledRows, num_tokens_no_spec, token_ids_cpu,
               tree_paths: dict[int, list[int]] | None = None, *, long_rest: bool = False) -> None:
        """Takes this step's accepted rows of each request, copied (vLLM reuses its
        buffers); those of a request holding max_pending_rows or more go through the block,
        or, in a long rest (long_rest), are cut to the latest recent_rows. tree_paths: by
        batch index, for requests verified as trees this step, the rows (within the
        request's) of the root and of each accepted node in path order: their states are
        the accepted positions', computed at those positions (tree_step.py)."""
        self.long_rest = long_rest
        live = set(req_ids)
        for req_id in [r for r in self.held_requests() if r not in live]:
            self.leave(req_id)
        reads_layers = bool(self.block.feature_layers)
        if reads_layers and (not rows.layer_states or len(rows.layer_states) != len(self.block.feature_layers)):
            raise RuntimeError(f"the draft block reads the states entering target layers "
                               f"{self.block.feature_layers}, and vLLM handed "
                               f"{len(rows.layer_states or [])} aux_hidden_states this step")
        offset, taken, takers = 0, [], []
        for i, req_id in enumerate(req_ids):
            n, start = int(rows.num_scheduled[i]), int(rows.num_computed[i])
            self._cache_ending_at(req_id, start, token_ids_cpu[i])
            known = min(n, int(num_tokens_no_spec[i]) - 1 - start)
            if known > 0:
                produced = token_ids_cpu[i, start + 1:start + 1 + known]
                self.tokens[req_id] += produced.tolist()
                taken += self._accepted_rows(offset, known, (tree_paths or {}).get(i))
                takers.append((req_id, produced))
            offset += n
        due = self._take(takers, taken, rows.hidden_states, rows.layer_states if reads_layers else None)
        if self.long_rest:
            for req_id in due:
                self._keep_recent(req_id)
        else:
            self._run_pending(due)

    def _keep_recent(self, req_id: str) -> None:
        """The request's latest recent_rows rows stay pending, on a cache that starts at
        their position; its other rows and entries are dropped unrun."""
        pending = self.pending[req_id]
        kept = pending.last(self.recent_rows)
        fresh = self.block.empty_cache()
        fresh.start = self.caches[req_id].length + pending.rows - kept.rows
        self.caches[req_id], self.pending[req_id] = fresh, kept
        self.newest.pop(req_id, None)

    def _take(self, takers: list, taken: list[int], hidden_states: torch.Tensor,
              layer_states: list[torch.Tensor] | None) -> list[str]:
        """The step's accepted rows, copied in one gather (vLLM reuses its buffers), then
        held by each request (takers: its id and produced tokens, in the rows' order) as
        views of that copy; the requests that now hold max_pending_rows or more.

        One gather a step, not a few small copies per request: at 64 requests on a CPU
        those copies took several milliseconds a step, for every step the heads rest. A
        step with a request's prompt chunk in it is copied again per request
        (max_shared_rows)."""
        if not takers:
            return []
        index = to_device_without_waiting(torch.tensor(taken), hidden_states.device)
        counts = [len(produced) for _, produced in takers]
        states = hidden_states.index_select(0, index).split(counts)
        tokens = torch.as_tensor(np.concatenate([produced for _, produced in takers]), dtype=torch.long).split(counts)
        layers = (torch.stack([state.index_select(0, index) for state in layer_states], 1).split(counts)
                  if layer_states is not None else [None] * len(takers))
        shared = max(counts) <= self.max_shared_rows
        due = []
        for (req_id, _), own_states, own_tokens, own_layers in zip(takers, states, tokens, layers):
            if not shared:
                own_states = own_states.clone()
                own_layers = None if own_layers is None else own_layers.clone()
            pending = self.pending.setdefault(req_id, PendingRows())
            pending.add(own_states, own_tokens, own_layers)
            if pending.rows >= self.max_pending_rows:
                due.append(req_id)
        return due

    @staticmethod
    def _accepted_rows(offset: int, known: int, path: list[int] | None) -> range | list[int]:
        """Where a request's `known` accepted rows are among the step's: its first ones, or
        on a tree its path's."""
        if path is None or path[:known] == list(range(known)):
            return range(offset, offset + known)
        if len(path) < known:
            raise RuntimeError(f"a tree request emitted {known} tokens and its verified path holds {len(path)} rows")
        return [offset + row for row in path[:known]]

    def _run_pending(self, req_ids: list[str]) -> None:
        """Runs the requests' pending rows through the block (all in one pass): into their
        caches, and their newest outputs."""
        req_ids = [r for r in req_ids if r in self.pending]
        if not req_ids:
            return
        pending = [self.pending.pop(r) for r in req_ids]
        caches = [self.caches[r] for r in req_ids]
        states = [torch.cat(p.states) for p in pending]
        produced = torch.cat([t for p in pending for t in p.tokens])
        produced = to_device_without_waiting(produced, states[0].device)
        embeds = self._embed(produced).split([p.rows for p in pending])
        layer_states = [torch.cat(p.layer_states) for p in pending] if self.block.feature_layers else None
        outputs = self.block.extend_many(caches, states, list(embeds), layer_states)
        for req_id, cache, out in zip(req_ids, caches, outputs):
            self.block.trim(cache)
            self.newest[req_id] = out[-1]

    def _cache_ending_at(self, req_id: str, position: int, tokens) -> BlockCache:
        """The request's cache, with its pending rows ending where this step's rows begin.
        tokens: the request's, from position 0 through at least `position`."""
        cache = self.caches.get(req_id)
        pending = self.pending.get(req_id)
        end = None if cache is None else cache.length + (pending.rows if pending is not None else 0)
        if cache is None or end < position or position < cache.start:
            self.forget(req_id)
            cache = self.store.take(tokens, position) if self.store is not None else None
            if cache is None:
                cache = self.block.empty_cache()
                cache.start = position
            self.caches[req_id] = cache
            self.tokens[req_id] = [int(t) for t in tokens[:position + 1]]
        elif end > position:
            del self.tokens[req_id][position + 1:]
            if position > cache.length:
                self.pending[req_id] = pending.first(position - cache.length)
            else:
                self.pending.pop(req_id, None)
            if position < cache.length:  # its newest output is of a position cut off
                self.newest.pop(req_id, None)
                self.block.truncate(cache, position)
        return cache

    def _drafting_from(self, batch_indices: list[int], req_ids: list[str]):
        """The drafted requests' caches and newest outputs [B, d], their pending rows run first."""
        drafted = [req_ids[i] for i in batch_indices]
        self._run_pending(drafted)
        missing = [r for r in drafted if r not in self.newest]
        if missing:
            raise RuntimeError(f"requests {missing} are drafted for, and the draft block's caches took no row of "
                               "theirs since they were last cut back")
        return [self.caches[r] for r in drafted], torch.stack([self.newest[r] for r in drafted])

    @torch.no_grad()
    def chain_probs(self, batch_indices: list[int], req_ids: list[str], depth: int, project,
                    temperatures: torch.Tensor, draft_ids: torch.Tensor | None, copy=None) -> torch.Tensor:
        """[B, depth, V] temperature-scaled probabilities along each request's own top-1
        chain from its newest accepted position, all requests drafted together (their
        pending rows first). copy: the copy bias's continuations (DraftBlock.draft_chains)."""
        caches, newest = self._drafting_from(batch_indices, req_ids)
        logits = self.block.draft_chains(caches, newest, depth, project, self._embed, draft_ids, copy).float()
        return torch.softmax(logits / temperatures[:depth, None], dim=-1)

    @torch.no_grad()
    def tree_step(self, batch_indices: list[int], req_ids: list[str], project, temperatures: torch.Tensor,
                  draft_ids: torch.Tensor | None):
        """(the newest outputs [B, d], the draft step) that grow the requests' dynamic trees
        from their newest accepted positions (DraftBlock.tree_step, grown_tree.py)."""
        caches, newest = self._drafting_from(batch_indices, req_ids)
        return newest, self.block.tree_step(caches, project, self._embed, temperatures, draft_ids)
