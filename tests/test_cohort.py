"""Pacing a batch that started together (cohort.py): who may draft, and when a batch counts
as one that started together."""
import pytest

from vllm_mtpspec.cohort import CohortPacer
from vllm_mtpspec.config import ConfigError, SpecOptions


def test_in_a_batch_that_started_together_only_the_requests_furthest_behind_draft():
    pacer = CohortPacer()
    pacer.step(["a", "b", "c", "d"])
    assert pacer.is_cohort
    # (max_tokens, tokens made): b and d are furthest behind, c within the slack of them.
    assert pacer.may_draft([(64, 14), (64, 4), (64, 6), (64, 4)], slack=3) == [False, True, True, True]
    assert pacer.may_draft([(64, 4)] * 4, slack=3) == [True] * 4


def test_requests_with_different_token_budgets_are_not_paced():
    # A server fills max_tokens in from each prompt's length: which ends last is not known.
    pacer = CohortPacer()
    pacer.step(["a", "b"])
    assert pacer.may_draft([(100, 30), (200, 2)], slack=3) == [True, True]


def test_a_batch_that_requests_keep_joining_is_not_paced():
    pacer = CohortPacer(join_window=4)
    pacer.step(["a", "b"])
    for _ in range(5):
        pacer.step(["a", "b"])
    pacer.step(["a", "b", "c"])  # joined 6 steps after the others
    assert not pacer.is_cohort
    assert pacer.may_draft([(64, 54), (64, 4), (64, 0)], slack=3) == [True] * 3
    # Once the late one has left, the two that started together are paced again.
    pacer.step(["a", "b"])
    assert pacer.is_cohort and pacer.may_draft([(64, 54), (64, 4)], slack=3) == [False, True]


def test_requests_without_a_token_budget_or_alone_are_not_paced():
    pacer = CohortPacer()
    pacer.step(["a", "b"])
    assert pacer.may_draft([None, (64, 54)], slack=3) == [True, True]
    pacer.step(["a"])
    assert not pacer.is_cohort


def test_pacing_is_refused_where_the_planner_does_not_plan():
    with pytest.raises(ConfigError, match="pace_cohorts='always'.*draft_size='fixed'"):
        SpecOptions(draft_size="fixed", pace_cohorts="always")
    with pytest.raises(ConfigError, match="pace_cohorts=True: choose one of"):
        SpecOptions(pace_cohorts=True)
    assert SpecOptions(draft_size="fixed", pace_cohorts="never").pace_cohorts == "never"


def test_the_runner_hook_reads_each_requests_token_budget():
    from types import SimpleNamespace

    from vllm_mtpspec.vllm.hooks import _token_budget

    runner = SimpleNamespace(requests={
        "a": SimpleNamespace(sampling_params=SimpleNamespace(max_tokens=64), output_token_ids=[1] * 10),
        "b": SimpleNamespace(sampling_params=SimpleNamespace(max_tokens=None), output_token_ids=[]),
        "c": SimpleNamespace(sampling_params=SimpleNamespace(max_tokens=4), output_token_ids=[1] * 6),
    })
    assert [_token_budget(runner, r) for r in ("a", "b", "c", "gone")] == [(64, 10), None, (4, 6), None]
