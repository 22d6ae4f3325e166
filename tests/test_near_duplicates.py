import random

from vllm_mtpspec.near_duplicates import jaccard, near_duplicates, shingles


def test_a_reworded_copy_is_found_and_an_unrelated_prompt_is_not():
    rng = random.Random(0)
    corpus = [[rng.randrange(50_000) for _ in range(rng.randrange(20, 200))] for _ in range(300)]
    copy = list(corpus[17])
    copy[5] = 7  # one token changed: most shingles survive
    longer = corpus[42] + [1, 2, 3]  # the same prompt with a few words added
    unrelated = [rng.randrange(50_000) for _ in range(80)]
    matches = near_duplicates([unrelated, copy, longer], corpus)
    assert [(m.query, m.corpus) for m in matches] == [(1, 17), (2, 42)]
    assert all(0.5 <= m.similarity < 1.0 for m in matches)
    assert matches[0].similarity == jaccard(shingles(copy), shingles(corpus[17]))


def test_prompts_sharing_a_common_opening_only_are_not_duplicates():
    opening = list(range(100, 112))  # "You are a helpful assistant. ..." before different requests
    rng = random.Random(1)
    corpus = [opening + [rng.randrange(50_000) for _ in range(60)] for _ in range(50)]
    query = opening + [rng.randrange(50_000) for _ in range(60)]
    assert near_duplicates([query], corpus) == []


def test_short_prompts_match_only_when_equal():
    assert [m.corpus for m in near_duplicates([[1, 2], [3]], [[3], [1, 2]])] == [1, 0]
    assert near_duplicates([[1, 2]], [[1, 3]]) == []
