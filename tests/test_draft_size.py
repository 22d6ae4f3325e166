"""The draft-size rules (draft_size.py) on their own, and the proposer's two questions to
them per step."""
import dataclasses
import gc
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.proposers import cpu_proposer
from vllm_mtpspec.checkpoint import save_heads
from vllm_mtpspec.config import ConfigError
from vllm_mtpspec.draft_planner import Candidate, DraftPlanner, PayGate
from vllm_mtpspec.draft_size import (
    Allowance,
    Drafted,
    FixedDraftSize,
    PlannedDraftSize,
    StepView,
    draft_size_rule,
)
from vllm_mtpspec.heads_init import init_heads


def view(n: int, *, sampled: bool = False, budgets=None) -> StepView:
    return StepView(tuple(f"r{i}" for i in range(n)), (1,) * n, None, (sampled,) * n, True, budgets)


def chains(*lengths: int) -> tuple[Candidate, ...]:
    return tuple(Candidate("heads", False, m, tuple(0.9 ** (k + 1) for k in range(m)), tuple(range(m)))
                 for m in lengths)


def test_the_fixed_rule_drafts_a_token_fewer_and_half_the_tree_nodes_per_doubling_past_the_start():
    rule = FixedDraftSize(depth=4, max_tree_budget=16, batch_backoff_start=4)
    batches = (1, 4, 5, 8, 9, 16, 17, 32, 33, 64, 1000)
    assert [rule.depth_for_batch(n) for n in batches] == [4, 4, 3, 3, 2, 2, 1, 1, 0, 0, 0]
    assert [rule.tree_budget_for_batch(n) for n in batches] == [16, 16, 8, 8, 4, 4, 2, 2, 1, 1, 1]
    assert rule.before_drafting(view(9)) == Allowance(depth=2, tree_budget=4, may_draft=None, heads=True)
    # It sends whatever was drafted within the allowance, whole, and keeps nothing.
    assert rule.after_drafting(Drafted((chains(2)[0], None, chains(1)[0]))) == (2, 0, 1)
    assert rule.after_drafting(Drafted(None)) == ()
    assert rule.held_requests() == set() and not rule.one_rank_decides


class RecordedPlanner:
    """Notes which of the planner's methods are called, in order."""

    def __init__(self, planner: DraftPlanner):
        self.calls = []
        for name in ("observe_step", "step_not_planned", "wants_proposal", "heads_would_run", "wants_heads", "plan",
                     "proposal_took", "verify_started"):
            method = getattr(planner, name)
            setattr(planner, name, lambda *a, _name=name, _method=method, **k: self.calls.append(_name)
                    or _method(*a, **k))

    def take(self) -> list[str]:
        calls, self.calls = self.calls, []
        return calls


def test_the_planned_rule_drafts_whole_below_the_start_and_plans_from_it():
    planner = DraftPlanner(3)
    recorded = RecordedPlanner(planner)
    rule = PlannedDraftSize(depth=3, max_tree_budget=8, batch_backoff_start=3, pacing="never", planner=planner)
    # Below the start: the fixed rule's whole drafts, and the planner matches nothing to them.
    assert rule.before_drafting(view(2)) == Allowance(3, 8)
    assert rule.after_drafting(Drafted(chains(3, 2), heads_needed=True)) == (3, 2)
    assert recorded.take() == ["step_not_planned"]
    # From it: the planner plans chains (no tree budget), and times the step that verifies them.
    assert rule.before_drafting(view(3)) == Allowance(3, 0, None, True)
    assert recorded.take() == ["observe_step", "wants_proposal", "heads_would_run"]
    assert rule.after_drafting(Drafted(chains(3, 3, 1), heads_needed=True)) == (3, 3, 1)  # nothing measured: all
    assert recorded.take() == ["wants_heads", "plan", "proposal_took", "verify_started"]
    assert rule.held_requests() == {"r0", "r1", "r2"}
    rule.forget("r1")
    assert rule.held_requests() == {"r0", "r2"}
    # Every request had a lookup draft: the heads' gate does not count the step.
    rule.before_drafting(view(3))
    recorded.take()
    rule.after_drafting(Drafted(chains(2, 2, 2), heads_needed=False))
    assert recorded.take() == ["plan", "proposal_took", "verify_started"]
    # Nothing proposed (the proposal rested, or no request had a row): no plan, the clock still starts.
    rule.before_drafting(view(3))
    recorded.take()
    assert rule.after_drafting(Drafted(None)) == ()
    assert recorded.take() == ["verify_started"]


def test_a_resting_proposal_drafts_nothing():
    planner = DraftPlanner(3)
    planner.wants_proposal = lambda batch_size, sampled: False
    rule = PlannedDraftSize(depth=3, max_tree_budget=8, batch_backoff_start=1, pacing="never", planner=planner)
    assert rule.before_drafting(view(4)) == Allowance(0, 0)


def test_the_planned_rule_paces_a_cohort_and_says_so_in_its_log_line():
    lines = []
    rule = PlannedDraftSize(depth=3, max_tree_budget=8, batch_backoff_start=1, pacing="default", log=lines.append,
                            log_every_seconds=0.0)
    budgets = ((64, 24), (64, 20), (64, 21))
    # Greedy and below GREEDY_PACED_FROM: not paced by default; with a sampled request: paced.
    assert rule.before_drafting(view(3, budgets=budgets)).may_draft is None
    rule.after_drafting(Drafted(chains(3, 3, 3)))
    allowance = rule.before_drafting(view(3, sampled=True, budgets=budgets))
    assert allowance.may_draft == (False, True, True) and rule.paced_steps == 1
    rule.after_drafting(Drafted((None,) + chains(3, 3), heads_needed=True))
    assert "2 of 3 requests, those that have made the fewest tokens, may draft" in lines[-1]


def test_the_gates_peek_answers_what_asking_would_without_counting_the_step():
    gate = PayGate(explore_every=3, warmup_runs=0, decay=0.9)
    gate.record(0.0, 1.0)  # added nothing for a second's work: rests, and checks every third step
    answers = []
    for _ in range(7):
        peeked = [gate.would_want(10.0) for _ in range(3)]
        resting = gate.resting
        answers.append(gate.wants(10.0))
        assert peeked == [answers[-1]] * 3 and gate.resting == resting + 1
    assert answers == [False, False, True, False, False, True, False]
    planner = DraftPlanner(3)
    assert planner.heads_would_run(4, False) and planner.wants_heads(4, False)  # nothing measured: they run


def test_the_rules_are_named_and_pacing_a_rule_that_does_not_plan_is_refused():
    sizes = dict(depth=3, max_tree_budget=8, batch_backoff_start=4)
    assert isinstance(draft_size_rule("fixed", **sizes), FixedDraftSize)
    assert isinstance(draft_size_rule("fixed", pacing="never", **sizes), FixedDraftSize)
    planned = draft_size_rule("planned", **sizes)
    assert isinstance(planned, PlannedDraftSize) and planned.pacing == "default" and planned.one_rank_decides
    with pytest.raises(ConfigError, match="pace_cohorts='always' paces the planner's drafts.*'fixed'"):
        draft_size_rule("fixed", pacing="always", **sizes)
    with pytest.raises(ConfigError, match="draft_size='learned': choose one of"):
        draft_size_rule("learned", **sizes)


# -- the proposer asks the rule twice a step, and hands it plain values ----------------------------

class RecordingRule:
    """The proposer's rule, passed through: every attribute the proposer reads of it and
    every call it makes are noted."""

    def __init__(self, rule):
        self.rule = rule
        self.reads: list[str] = []
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name):
        self.reads.append(name)
        value = getattr(self.rule, name)
        if name == "clock" or not callable(value):
            return value

        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return value(*args, **kwargs)

        return call

    def take(self):
        reads, calls, self.reads, self.calls = self.reads, self.calls, [], []
        return reads, calls


def is_plain(value) -> bool:
    """A value built of numbers, strings, tuples and frozen dataclasses of them only."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, tuple):
        return all(is_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and value.__dataclass_params__.frozen:
        return all(is_plain(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


def reaches(start, target) -> bool:
    """Whether target can be reached from start through attributes, containers, bound
    methods and closures (not through modules, classes or a function's globals)."""
    seen, todo = set(), [start]
    while todo:
        obj = todo.pop()
        if obj is target:
            return True
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.CodeType, str, bytes, int, float)):
            continue
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            todo.extend(cell.cell_contents for cell in obj.__closure__ or () if cell.cell_contents is not None)
            continue
        todo.extend(gc.get_referents(obj))
    return False


@pytest.fixture
def make_proposer(tiny_model, tiny_model_dir, tmp_path):
    heads_dir = save_heads(init_heads(tiny_model, tiny_model_dir, num_heads=3, init_std=0.5, seed=3),
                           tmp_path / "heads")

    def make(**options):
        options = {"heads": str(heads_dir), "min_path_prob": 0.0, "batch_backoff_start": 4, "prompt_lookup_max": 3,
                   **options}
        return cpu_proposer(tiny_model, tiny_model_dir, options)

    return make


def steps(p, sizes, sampled=False):
    """One propose() per batch size, each request a token budget and, for request 0, a
    context that repeats (a lookup draft)."""
    hidden_size = p.heads_config.hidden_size
    for step, n in enumerate(sizes):
        token_ids = np.zeros((n, 16), dtype=np.int64)
        token_ids[:, :5] = np.arange(10, 15)
        token_ids[0, :9] = [4, 5, 6, 7, 8, 9, 4, 5, 6]
        budget = [(64, 24)] + [(64, 20)] * (n - 1)
        hidden = torch.randn(n, hidden_size, generator=torch.Generator().manual_seed(step))
        p.capture_step(hidden, None, [f"r{i}" for i in range(n)], decode_only=True,
                       sampled=lambda i: sampled, budget=budget.__getitem__)
        yield p.propose([[6]] + [[14]] * (n - 1), np.array([9] + [5] * (n - 1)), token_ids)


@pytest.mark.parametrize("options", [
    dict(draft_size="fixed"),
    dict(draft_size="planned"),
    dict(draft_size="planned", pace_cohorts="always"),
    dict(draft_size="planned", prompt_lookup_max=0),
], ids=["fixed", "planned", "planned-paced", "planned-without-lookup"])
def test_the_proposer_asks_the_rule_twice_a_step_and_hands_it_plain_values_only(make_proposer, options):
    p = make_proposer(**options)
    rule = RecordingRule(p.draft_size)
    p.draft_size = rule
    sent = 0
    # Below the back-off start, at it and past it; twice each, so that drafts get verified.
    for drafts in steps(p, [2, 2, 4, 4, 9, 9]):
        reads, calls = rule.take()
        assert [name for name, _, _ in calls] == ["before_drafting", "after_drafting"]
        assert set(reads) <= {"before_drafting", "after_drafting", "clock"}
        (_, (asked,), asked_kw), (_, (told,), told_kw) = calls
        assert isinstance(asked, StepView) and isinstance(told, Drafted) and not asked_kw and not told_kw
        assert is_plain(asked) and is_plain(told)
        sent += sum(map(len, drafts))
    assert sent and not reaches(rule.rule, p)
    if p.planner is not None:
        assert rule.rule.planner.last.batch_size == 9  # it planned the batch past the start


def test_the_checks_above_catch_what_they_look_for(make_proposer):
    p = make_proposer(draft_size="planned")
    assert reaches(PlannedDraftSize(depth=3, max_tree_budget=8, batch_backoff_start=1, log=lambda line: p.forget(line)),
                   p)
    assert not is_plain(SimpleNamespace(depth=3)) and not is_plain([1]) and not is_plain(lambda: 1)
    assert not is_plain(Drafted((None,), drafting_seconds=torch.tensor(1.0)))


class SharedBroadcast:
    """Two tensor-parallel ranks in one process, stepping in turn: rank 0's broadcast
    reaches rank 1."""

    def __init__(self):
        self.sent = []

    def rank(self, rank_in_group):
        shared = self

        def broadcast_object(obj=None, src=0):
            if rank_in_group == 0:
                shared.sent.append(obj)
                return obj
            return shared.sent.pop(0)

        return SimpleNamespace(world_size=2, rank_in_group=rank_in_group, broadcast_object=broadcast_object)


@pytest.mark.parametrize("draft_size", ["fixed", "planned"])
def test_a_rule_deciding_from_one_ranks_clock_is_asked_on_rank_zero_only(make_proposer, draft_size):
    from vllm_mtpspec.vllm.parallel import RankZeroDecision

    broadcast = SharedBroadcast()
    ranks = [make_proposer(draft_size=draft_size, batch_backoff_start=1) for _ in range(2)]
    rules = []
    for rank, p in enumerate(ranks):
        p.__dict__["_rank_zero"] = RankZeroDecision(broadcast.rank(rank))
        rules.append(RecordingRule(p.draft_size))
        p.draft_size = rules[-1]
    for drafts in zip(*(steps(p, [3, 3, 3], sampled=True) for p in ranks)):
        assert drafts[0] == drafts[1]
        asked = [[name for name, _, _ in rule.take()[1]] for rule in rules]
        assert asked[0] == ["before_drafting", "after_drafting"]
        # The planner's clock is one rank's: rank 1 takes rank 0's answers and asks its own rule nothing.
        assert asked[1] == ([] if draft_size == "planned" else asked[0])


def test_the_planned_rule_says_when_the_heads_rest_long_and_never_on_a_step_they_run():
    planner = DraftPlanner(3)
    rule = PlannedDraftSize(depth=3, max_tree_budget=8, batch_backoff_start=1, pacing="never", planner=planner)
    rest = {"proposal": False, "heads": False}
    planner.heads_rest_long = lambda batch_size, sampled: rest["proposal"] or rest["heads"]
    planner.wants_proposal = lambda batch_size, sampled: not rest["proposal"]
    planner.heads_would_run = lambda batch_size, sampled: not rest["heads"]
    assert rule.before_drafting(view(4)).long_rest is False
    rest["heads"] = True  # lookup may still draft; the heads rest long
    assert rule.before_drafting(view(4)) == Allowance(3, 0, None, False, long_rest=True)
    rest["proposal"] = True
    assert rule.before_drafting(view(4)) == Allowance(0, 0, long_rest=True)
    rest["proposal"] = rest["heads"] = False
    planner.heads_rest_long = lambda batch_size, sampled: True  # a check of a long rest: the heads run
    assert rule.before_drafting(view(4)) == Allowance(3, 0, None, True, long_rest=False)
    # Below the back-off start, whole chains and no rest.
    below = PlannedDraftSize(depth=3, max_tree_budget=8, batch_backoff_start=8, pacing="never", planner=planner)
    assert below.before_drafting(view(4)).long_rest is False
