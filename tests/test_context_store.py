"""The draft block's entries outlive their request, for a later one that begins with the
same tokens (vllm/context_store.py): what vLLM's prefix cache skips, the store gives back."""
import numpy as np
import pytest
import torch

from tests.test_draft_block import make_block, random_sequence
from vllm_mtpspec.draft_block import BlockCache
from vllm_mtpspec.vllm.block_context import BlockContexts, ScheduledRows
from vllm_mtpspec.vllm.context_store import ContextStore


def cache_of(length: int, start: int = 0, seed: int = 0) -> BlockCache:
    """Entries at positions start .. length - 1, each entry's values marking its position."""
    size = length - start
    keys = torch.randn(2, size, 8, generator=torch.Generator().manual_seed(seed))
    values = torch.arange(start, length, dtype=torch.float32)[None, :, None].expand(2, size, 8).clone()
    return BlockCache(keys, values, start, size)


def tokens_of(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_request_with_the_same_tokens_gets_the_entries_before_its_first_uncached_position():
    store = ContextStore(1 << 20)
    tokens = tokens_of(41)
    stored = cache_of(40)
    store.put(tokens, stored)
    for position in (16, 32):
        cache = store.take(np.array(tokens + [7, 7]), position)
        assert (cache.start, cache.length) == (0, position)
        keys, values = cache.held()
        torch.testing.assert_close(keys, stored.keys[:, :position])
        assert values[0, :, 0].tolist() == list(range(position))
    cache.append(torch.zeros(2, 5, 8), torch.zeros(2, 5, 8))   # a copy: appending leaves the store's alone
    again = store.take(tokens, 32)
    torch.testing.assert_close(again.held()[0], stored.keys[:, :32])
    assert store.restored == 3


@pytest.mark.parametrize("case", ["another token at the first uncached position", "another token before it",
                                  "not at a key stride", "past the stored entries", "at position 0"])
def test_no_entries_come_back_unless_every_token_they_read_is_the_same(case):
    store = ContextStore(1 << 20)
    tokens = tokens_of(41)
    store.put(tokens, cache_of(40))
    asked, position = list(tokens) + [1] * 40, 32
    if case == "another token at the first uncached position":
        asked[32] += 1      # entry 31 read token 32
    elif case == "another token before it":
        asked[3] += 1
    elif case == "not at a key stride":
        position = 33
    elif case == "past the stored entries":
        position = 48
    else:
        position = 0
    assert store.take(asked, position) is None
    assert store.restored == 0


def test_a_window_trimmed_cache_gives_back_only_what_it_still_holds():
    store = ContextStore(1 << 20)
    tokens = tokens_of(65)
    store.put(tokens, cache_of(64, start=20))  # positions 0-19 fell out of its window
    assert store.take(tokens, 16) is None
    cache = store.take(tokens, 48)
    assert (cache.start, cache.length) == (20, 48)


def test_the_store_keeps_to_its_bytes_and_drops_the_least_recently_used_first():
    entry_bytes = 2 * 2 * 32 * 8 * 4   # keys and values, 2 heads x 32 entries x 8 dims of fp32
    store = ContextStore(2 * entry_bytes)
    conversations = [tokens_of(33, seed=s) for s in range(3)]
    store.put(conversations[0], cache_of(32, seed=0))
    store.put(conversations[1], cache_of(32, seed=1))
    assert store.take(conversations[0], 32) is not None      # 0 is now the most recently used
    store.put(conversations[2], cache_of(32, seed=2))        # so 1 goes
    assert store.held_bytes == 2 * entry_bytes and len(store) == 2
    assert store.take(conversations[1], 32) is None
    assert store.take(conversations[0], 32) is not None and store.take(conversations[2], 32) is not None
    too_big = ContextStore(entry_bytes - 1)
    too_big.put(conversations[0], cache_of(32))
    assert len(too_big) == 0 and too_big.held_bytes == 0


def test_the_newest_request_with_a_prefix_wins_and_an_older_one_keeps_its_own_longer_keys():
    store = ContextStore(1 << 20)
    shared = tokens_of(20)
    first, second = shared + tokens_of(30, seed=1), shared + tokens_of(30, seed=2)
    store.put(first[:49], cache_of(48, seed=1))
    store.put(second[:49], cache_of(48, seed=2))
    torch.testing.assert_close(store.take(first, 16).held()[0], cache_of(48, seed=2).keys[:, :16])
    torch.testing.assert_close(store.take(first, 32).held()[0], cache_of(48, seed=1).keys[:, :32])
    torch.testing.assert_close(store.take(second, 32).held()[0], cache_of(48, seed=2).keys[:, :32])


def test_a_cache_needs_the_tokens_its_entries_read():
    with pytest.raises(ValueError, match="needs tokens 0..40"):
        ContextStore(1 << 20).put(tokens_of(40), cache_of(40))


@torch.no_grad()
@pytest.mark.parametrize("store_mb", [1, None], ids=["with a store", "without one"])
def test_a_request_served_from_the_prefix_cache_drafts_from_the_whole_context_a_finished_one_left(store_mb):
    """Request a is fed positions 0..39 and finishes; b shares its first 33 tokens, and vLLM
    computes b from position 32 on (a prefix-cache hit on two 16-token blocks). With the
    store, b drafts from entries 0..31 (a's) and its own: as a cache fed b's positions from
    0 would. Without it, b's cache starts at 32."""
    block = make_block(num_heads=2)
    features, embed, tokens = random_sequence(48)
    store = ContextStore(store_mb << 20) if store_mb else None
    contexts = BlockContexts(block, torch.nn.Embedding.from_pretrained(embed), store)
    token_ids = np.zeros((1, 64), dtype=np.int64)
    token_ids[0, :52] = tokens.numpy()

    def step(req_id: str, start: int, n: int) -> torch.Tensor:
        rows = ScheduledRows(hidden_states=features[start:start + n], num_scheduled=[n], num_computed=[start])
        contexts.update([req_id], rows, [start + n + 1], token_ids)
        contexts._run_pending([req_id])
        return contexts.newest[req_id]

    def fed_only(start: int, end: int, tokens: torch.Tensor) -> torch.Tensor:
        cache = block.empty_cache(dtype=torch.float64)
        cache.start = start
        return block.extend(cache, features[start:end], embed[tokens[start + 1:end + 1]])[-1]

    step("a", 0, 24)
    step("a", 24, 16)
    contexts.leave("a")          # finished: the hook's call
    assert "a" not in contexts.held_requests()
    # b ends otherwise than a, past the shared prefix (entry 39 read token 40).
    tokens_b = tokens.clone()
    tokens_b[40:52] = (tokens[40:52] + 1) % embed.shape[0]
    token_ids[0, :52] = tokens_b.numpy()
    out = step("b", 32, 12)
    if store_mb:
        torch.testing.assert_close(out, fed_only(0, 44, tokens_b))
        assert contexts.caches["b"].start == 0 and store.restored == 1
    else:
        torch.testing.assert_close(out, fed_only(32, 44, tokens_b))
        assert contexts.caches["b"].start == 32
    # A request that leaves the batch without the finish hook (preempted) leaves its entries too.
    contexts.update([], ScheduledRows(hidden_states=features[:0], num_scheduled=[], num_computed=[]), [], token_ids)
    assert "b" not in contexts.held_requests()
    if store_mb:
        assert len(store) == 2


@pytest.mark.parametrize("value", [-1, 1.5, True, "64"])
def test_the_store_size_is_a_whole_number_of_mib(value):
    from vllm_mtpspec.config import ConfigError, SpecOptions

    with pytest.raises(ConfigError, match="context_store_mb=.*whole number of MiB"):
        SpecOptions(heads="h", context_store_mb=value)
    assert SpecOptions(heads="h", context_store_mb=0).context_store_mb == 0
