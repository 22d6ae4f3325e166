"""The copy bias: a draft block's chain leans toward what its context repeats, as drafting
runs it and as the teacher-forced replay scores it."""
import math

import numpy as np
import pytest
import torch

from tests.test_draft_block import VOCAB, D, drafted_chain, make_block, random_sequence
from vllm_mtpspec.config import BlockConfig, ConfigError, HeadsConfig
from vllm_mtpspec.copy_bias import (
    LONGEST_REPEAT,
    along_answer,
    copy_drafts,
    following_after,
    lean,
    longest_repeat,
    repeat_bucket,
)


def brute_force_repeat(tokens: list[int], k: int) -> tuple[int, list[int]]:
    """The longest suffix (up to LONGEST_REPEAT) found ending at an earlier position, its
    most recent such position, and what followed it: by trying every length and position."""
    best, follow = 0, []
    for n in range(1, min(LONGEST_REPEAT, len(tokens) - 1) + 1):
        ends = [e for e in range(n - 1, len(tokens) - 1) if tokens[e - n + 1:e + 1] == tokens[-n:]]
        if not ends:
            break
        best, follow = n, tokens[ends[-1] + 1:ends[-1] + 1 + k]
    return best, follow


def test_the_longest_repeat_is_the_most_recent_of_the_longest_earlier_ones():
    tokens = np.array([1, 2, 9, 1, 2, 8, 1, 2])       # "1 2" twice before; "8 1 2" never
    n, follow = longest_repeat(tokens, 3)
    assert n == 2 and follow.tolist() == [8, 1, 2]     # the later "1 2" (ending at 4), not the first
    n, follow = longest_repeat(np.array([3, 4, 5]), 3)
    assert n == 0 and follow.tolist() == []            # the newest token is new
    n, follow = longest_repeat(np.array([7, 7, 7, 7]), 2)
    assert n == 3 and follow.tolist() == [7]           # "7 7 7" ends at 2, overlapping the suffix: one token follows
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 3, size=int(rng.integers(2, 60))).tolist()
        n, follow = longest_repeat(np.array(tokens), 4)
        assert (n, follow.tolist()) == brute_force_repeat(tokens, 4), tokens
    looped = [1, 2] * 40                               # a repeat longer than the cap
    assert longest_repeat(np.array(looped), 3)[0] == LONGEST_REPEAT


def test_repeat_lengths_take_the_bias_of_the_longest_bucket_they_reach():
    assert [repeat_bucket(n) for n in (0, 1, 3, 5, 7, 8, 31, 32, 99)] == [0, 1, 3, 4, 4, 8, 16, 32, 32]


def test_lean_adds_the_bias_only_where_the_chain_follows_and_the_draft_vocabulary_has_the_token():
    logits = torch.zeros(3, 4)
    draft_ids = torch.tensor([10, 11, 12, 13])
    copy = torch.tensor([12, 99, 10])                 # 99 is outside the draft vocabulary
    out = lean(logits, copy, torch.tensor([2.0, 3.0, 5.0]), torch.tensor([True, True, False]), draft_ids)
    assert out.tolist() == [[0, 0, 2.0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    full = lean(torch.zeros(2, 20), torch.tensor([-1, 13]), torch.tensor([2.0, 3.0]), torch.tensor([True, True]))
    assert full[0].abs().sum() == 0 and full[1, 13] == 3.0
    assert following_after(torch.tensor([True, True, False]), torch.tensor([2, 2, 0]), torch.tensor([12, 13, 10]),
                           draft_ids).tolist() == [True, False, False]


def test_copy_drafts_carry_the_continuation_where_its_repeat_has_a_bias():
    contexts = [np.array([5, 6, 7, 5, 6]), np.array([1, 2, 3]), np.array([4, 8, 4])]
    tokens, bias = copy_drafts(contexts, 3, {"2": 1.5}, torch.device("cpu"))
    # "5 6" repeats (2 tokens: biased); nothing repeats in the second; "4" alone has no bias.
    assert tokens.tolist() == [[7, 5, 6], [-1, -1, -1], [-1, -1, -1]] and bias.tolist() == [1.5, 0.0, 0.0]


def test_along_an_answer_a_depth_is_leaned_while_the_answer_has_followed_the_continuation():
    context = np.array([1, 2, 3, 4, 1, 2, 3, 9, 9])    # prompt 1 2 3 4; answer 1 2 3 9 9
    tokens, bias = along_answer(context, 4, 5, 3, {"1": 1.0, "2": 2.0, "3": 3.0})
    # Row 0 (context ends "4 1"): "1" follows "2 3 4"; the answer goes 2 3 (right), 9 (wrong).
    assert tokens[0].tolist() == [2, 3, 4] and bias[0].tolist() == [1.0, 1.0, 1.0]
    # Row 2 (ends "1 2 3"): "4" follows, the answer has 9: depth 1 leans, deeper ones do not.
    assert tokens[2].tolist() == [4, -1, -1] and bias[2].tolist() == [3.0, 0.0, 0.0]
    assert tokens[3].tolist() == [-1, -1, -1]          # "9" is new


def test_heads_configs_refuse_a_copy_bias_they_cannot_take():
    block = BlockConfig(attention_heads=4, kv_heads=2, head_dim=8, mlp_size=64)
    config = HeadsConfig(num_heads=3, hidden_size=D, vocab_size=VOCAB, head_kind="attention", block=block,
                         head_input="hidden+token", copy_bias={"4": 2, "32": 100.0})
    assert config.copy_bias == {"4": 2.0, "32": 100.0}
    with pytest.raises(ConfigError, match=r"copy_bias key '5': repeat lengths are 1, 2, 3, 4, 8, 16, 32; refit it "):
        HeadsConfig(num_heads=3, hidden_size=D, vocab_size=VOCAB, head_kind="attention", block=block,
                    head_input="hidden+token", copy_bias={"5": 1.0})
    with pytest.raises(ConfigError, match=r"copy_bias\['1'\]=nan: give a number"):
        HeadsConfig(num_heads=3, hidden_size=D, vocab_size=VOCAB, head_kind="attention", block=block,
                    head_input="hidden+token", copy_bias={"1": math.nan})
    with pytest.raises(ConfigError, match=r"copy_bias with head_kind='parallel': only an attention draft block"):
        HeadsConfig(num_heads=3, hidden_size=D, vocab_size=VOCAB, copy_bias={"1": 1.0})


def repeating_sequence(t: int):
    """random_sequence's features and embeddings with tokens that repeat (a small alphabet
    and a copied stretch), so that repeats of every length up to a few occur."""
    features, embed, _ = random_sequence(t)
    generator = torch.Generator().manual_seed(5)
    head = torch.randint(0, 4, (t // 2,), generator=generator)
    tokens = torch.cat([head, head[:t - len(head) - 2], torch.randint(0, 4, (6,), generator=generator)])
    return features, embed, tokens


@torch.no_grad()
@pytest.mark.parametrize("with_draft_vocab", [False, True])
def test_the_replay_leans_every_answer_row_as_drafting_leans_the_chain_of_a_block_fed_up_to_it(with_draft_vocab):
    """vllm_mtpspec_train.evaluate.block_answer_logits with a copy bias against
    DraftBlock.draft_chains given copy_drafts of the context up to each answer row: the
    same logits at depth 1, and at each deeper depth where the chain drafted the answer's
    tokens so far (the replay feeds the answer's, drafting its own)."""
    from vllm_mtpspec_train.evaluate import block_answer_logits

    block = make_block(num_heads=3)
    draft_ids = torch.tensor([0, 1, 2, 5, 7]) if with_draft_vocab else None
    if draft_ids is not None:
        block = block.with_draft_vocab(draft_ids)
    block.config.copy_bias = {"1": 0.5, "2": 1.5, "3": 4.0, "4": 100.0}
    features, embed, tokens = repeating_sequence(24)
    lm_head = 3 * torch.randn(VOCAB, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    project = block.lm_head_for(lm_head)
    first = 9                                         # rows 0..7 the prompt's, 8..23 the answer's
    prompt, answer = tokens[:first], tokens[first:first + 16]
    shard = {"prompt_ids": [prompt.tolist()], "offsets": torch.tensor([0, 16]), "tokens": answer,
             "hidden": features[8:24], "context_hidden": features[:8], "context_offsets": torch.tensor([0, 8])}
    replay = torch.cat([logits for _, logits in block_answer_logits(block, shard, 0, project, embed, chunk=5)])
    leaned_rows = compared = 0
    for r in range(15):
        q = 8 + r                                     # answer row r is row q; its root token is tokens[q + 1]
        cache = block.empty_cache(dtype=torch.float64)
        newest = block.extend(cache, features[:q + 1], embed[tokens[1:q + 2]])[-1]
        copy = copy_drafts([tokens[:q + 2].numpy()], 3, block.config.copy_bias, torch.device("cpu"))
        drafted = block.target_vocab_logits(block.draft_chains([cache], newest[None], 3, project,
                                                               lambda t: embed[t], block.draft_vocab, copy))[0]
        plain = block.target_vocab_logits(block.draft_chains([cache], newest[None], 3, project,
                                                             lambda t: embed[t], block.draft_vocab))[0]
        leaned_rows += int(not torch.equal(drafted[0], plain[0]))
        for i in range(3):
            if r + i + 1 >= 16:
                break
            # (The replay's pass rounds apart from drafting's by far less than any bias.)
            torch.testing.assert_close(drafted[i], replay[r, i], rtol=1e-5, atol=1e-5)
            compared += 1
            if drafted[i].argmax() != answer[r + i + 1]:
                break                                 # the chain left the answer: deeper depths differ
    assert leaned_rows >= 5 and compared > 15


@torch.no_grad()
def test_a_bias_past_every_gap_drafts_the_repeat_for_as_long_as_it_runs():
    block = make_block(num_heads=3)
    features, embed, tokens = random_sequence(8)
    lm_head = torch.randn(VOCAB, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    cache = block.empty_cache(dtype=torch.float64)
    newest = block.extend(cache, features, embed[tokens[1:9]])[-1]
    continuation = torch.tensor([[11, 12, -1]])       # the repeat is followed by two tokens only
    logits = block.draft_chains([cache], newest[None], 3, lambda x: x @ lm_head.T, lambda t: embed[t],
                                copy=(continuation, torch.tensor([100.0], dtype=torch.float64)))
    plain = block.draft_chains([cache], newest[None], 3, lambda x: x @ lm_head.T, lambda t: embed[t])
    assert logits[0, :2].argmax(-1).tolist() == [11, 12] and plain[0, :2].argmax(-1).tolist() != [11, 12]
    # Depth 3 has no continuation: it is the block's own guess along the copied tokens.
    third = drafted_chain(block, cache, newest, embed, torch.tensor([11, 12]), 3)[2]
    torch.testing.assert_close(logits[0, 2], third @ lm_head.T)
    assert cache.length == 8


def test_the_fit_biases_the_repeats_that_are_right_and_leaves_the_ones_that_are_wrong():
    from vllm_mtpspec_train.fit_copy_bias import AnswerRows, fit

    answer = np.arange(5)
    ahead = np.append(answer[1:], -1)[:, None]        # what depth 1 should draft at each row
    # A: the block is always wrong, each row's 4-token repeat right, 1.2 logits below.
    copied = AnswerRows("a", "test", np.array([7]), answer, np.full((5, 1), 99), ahead,
                        np.full((5, 1), 1.2, np.float32), np.full(5, 4))
    # B: the block is always right, each row's 8-token repeat wrong, 0.7 below.
    own = AnswerRows("b", "test", np.array([7]), answer, ahead, np.full((5, 1), 77),
                     np.full((5, 1), 0.7, np.float32), np.full(5, 8))
    biases, before, after = fit([copied, own], depth=1)
    assert biases == {4: 1.5}                          # the least bias on the grid past A's gap; none for B
    # Without: A takes 4 steps of 1 token, B 2 of 2 (8 tokens in 6 steps); with: 2 of 2 each.
    assert before == pytest.approx(8 / 6) and after == pytest.approx(2.0)
