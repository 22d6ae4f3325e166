"""The draft block's entries of requests that left the batch, for later requests that begin
with the same tokens.

vLLM serves a prompt's shared prefix (the earlier turns of a chat, a system prompt, the
same prompt sent again) from its prefix cache: the target never recomputes those
positions, so the block never sees their states, and a new request's cache would start at
the first uncached token (block_context.py) and draft from less than the first request
did. The block is one layer: its entry at position p depends only on the target's state
at p and the token at p + 1, and the target's state at p depends only on tokens 0..p. So
the entries an earlier request left for positions 0..P-1 are the entries a request whose
tokens 0..P are the same would compute, and they can stand in for the cached prefix.

Workers never see vLLM's block hashes (they live in the scheduler's process), so entries
are found by a chained hash of the tokens themselves, taken at every KEY_STRIDE-th
position: a prefix-cache hit covers whole KV blocks, which are multiples of 16 tokens (16
on GPUs, 128 by default on CPUs). A hit is confirmed token for token before it is used.

The entries stay where the block's caches live (the GPU's memory on a GPU), outside vLLM's
KV-cache accounting: the store is bounded in bytes and drops the least recently used
first. Every tensor-parallel rank sees the same tokens and so keeps and finds the same
entries.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from vllm_mtpspec.draft_block import BlockCache

KEY_STRIDE = 16
# At most ~1.5 MB per request for the shipped block (a window of 1,024 entries of 3 KV heads
# of 64 in fp32): 64 MiB keep the last few dozen conversations.
DEFAULT_CONTEXT_STORE_MB = 64


def prefix_keys(tokens: list[int], first: int, last: int) -> dict[int, int]:
    """{P: the key of tokens 0..P} for every multiple P of KEY_STRIDE in [first, last]."""
    keys, running = {}, 0
    for position in range(KEY_STRIDE, last + 1, KEY_STRIDE):
        running = hash((running, tuple(tokens[position - KEY_STRIDE:position])))
        if position >= first:
            keys[position] = hash((running, tokens[position]))
    return keys


@dataclass
class _Stored:
    tokens: list[int]      # positions 0 .. cache.length: the last is the one the newest entry read
    cache: BlockCache      # compact: its buffers hold its entries only
    keys: list[int]
    bytes: int


class ContextStore:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held_bytes = 0
        self._stored: OrderedDict[int, _Stored] = OrderedDict()   # least recently used first
        self._by_key: dict[int, int] = {}
        self._next_id = 0
        self.restored = 0  # requests whose cache began from stored entries (logs, tests)

    def __len__(self) -> int:
        return len(self._stored)

    def put(self, tokens: list[int], cache: BlockCache) -> None:
        """Keeps a cache's entries (positions cache.start .. cache.length - 1), whose
        request's tokens 0 .. cache.length are `tokens`. Only positions past cache.start
        can be restored to: there at least one entry comes back."""
        if len(tokens) != cache.length + 1:
            raise ValueError(f"a cache ending at position {cache.length} needs tokens 0..{cache.length}, "
                             f"and {len(tokens)} came")
        keys = prefix_keys(tokens, cache.start + 1, cache.length)
        if not keys:
            return
        compact = cache.clone()
        size = 2 * compact.keys.numel() * compact.keys.element_size()
        if size > self.max_bytes:
            return
        while self.held_bytes + size > self.max_bytes:
            self._drop(next(iter(self._stored)))
        stored_id, self._next_id = self._next_id, self._next_id + 1
        self._stored[stored_id] = _Stored(tokens, compact, list(keys.values()), size)
        self.held_bytes += size
        for key in keys.values():  # the newest request that began so wins
            self._by_key[key] = stored_id

    def take(self, tokens, position: int) -> BlockCache | None:
        """A cache of entries for positions < `position` (a copy: the caller appends to
        it), from a request whose tokens 0..position were `tokens[:position + 1]`, or None."""
        if position <= 0 or position % KEY_STRIDE or not self._stored:
            return None
        prefix = [int(t) for t in tokens[:position + 1]]
        stored_id = self._by_key.get(prefix_keys(prefix, position, position)[position])
        stored = self._stored.get(stored_id)
        if stored is None or stored.tokens[:position + 1] != prefix:
            return None
        self._stored.move_to_end(stored_id)
        keys, values = stored.cache.held()
        size = position - stored.cache.start
        self.restored += 1
        return BlockCache(keys[:, :size].clone(), values[:, :size].clone(), stored.cache.start, size)

    def _drop(self, stored_id: int) -> None:
        stored = self._stored.pop(stored_id)
        self.held_bytes -= stored.bytes
        for key in stored.keys:
            if self._by_key.get(key) == stored_id:
                del self._by_key[key]
