import numpy as np
import pytest

from vllm_mtpspec.lookup import lookup_draft


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # most recent first, never the suffix itself
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_copies_what_followed_the_most_recent_longest_match():
    #          0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 7, 1, 2, 9, 6, 7, 3, 4, 6, 7]
    # Suffix (6, 7) occurred at 1 and 6; the most recent is followed by 3, 4.
    assert lookup_draft(np.array(tokens), min_n=2, max_n=4, k=3) == [3, 4, 6]
    # A longer match wins over a more recent shorter one.
    tokens = [1, 2, 3, 8, 8, 9, 2, 3, 5, 1, 2, 3]
    assert lookup_draft(np.array(tokens), min_n=2, max_n=4, k=2) == [8, 8]
    assert lookup_draft(np.array([1, 2, 3, 4]), min_n=2, max_n=4, k=3) == []
    assert lookup_draft(np.array([7]), min_n=1, max_n=4, k=3) == []


@pytest.mark.parametrize("seed", range(20))
def test_agrees_with_a_brute_force_search(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 4, size=int(rng.integers(1, 60))).tolist()
    for min_n, max_n, k in [(1, 1, 2), (2, 4, 3), (3, 5, 5)]:
        assert lookup_draft(np.array(tokens), min_n=min_n, max_n=max_n, k=k) == brute_force(tokens, min_n, max_n, k)
