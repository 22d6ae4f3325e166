"""How much each request drafts: one rule the proposer asks once before a step's drafting
and tells once after it.

How much to draft (`draft_size`) follows one of two rules. "fixed": chain depth and
tree size shrink for large batches, where verifying extra tokens stops being free (sooner
on CPUs). "planned": from batch_backoff_start requests up, the draft planner
(draft_planner.py) gives each request the drafts whose expected accepted tokens are worth
the verify time they add, by step costs it measures while serving, and skips the whole
proposal (lookup included) for kinds of batch where no drafts have paid for its time;
smaller batches draft whole chains. In a batch whose requests started together, only
those that have made the fewest tokens are offered to the planner (cohort.py).

Before drafting the proposer hands the rule what the step that just ended showed
(StepView) and gets an Allowance: how deep a chain and how large a tree, which requests
may draft, whether the heads may run. After drafting it hands over what it drafted and
what that took (Drafted) and gets how many of each request's drafts to send. The rule
sees plain values only, never the proposer, so that it can be read, tested and replaced
on its own, and so that its answers can be broadcast: with tensor parallelism a rule that
decides from state one rank alone holds (the planner's clock) answers on rank 0 for every
rank (vllm/parallel.py).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from vllm_mtpspec.cohort import GREEDY_PACED_FROM, CohortPacer
from vllm_mtpspec.config import DRAFT_SIZES, ConfigError
from vllm_mtpspec.draft_planner import Candidate, DraftPlanner


@dataclass(frozen=True)
class StepView:
    """The batch about to draft, and what the step that just ended did."""

    req_ids: tuple[str, ...]                  # the running requests, in batch order
    emitted: tuple[int, ...]                  # tokens each emitted in the step that just ended
    verified: tuple[int, ...] | None          # drafts each had verified in it (None: nobody had drafts)
    sampled: tuple[bool, ...]                 # whether each samples (temperature > 0)
    timed: bool                               # that step prefilled no prompt: its time is a verify step's
    # Each one's max_tokens and the tokens it has made (None without max_tokens); None: not known.
    budgets: tuple[tuple[int, int] | None, ...] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.req_ids)


@dataclass(frozen=True)
class Allowance:
    """What may be drafted this step. Plain values: rank 0's is sent to every rank."""

    depth: int                                # the deepest chain (0: nothing is drafted this step)
    tree_budget: int                          # the most tree nodes per request
    may_draft: tuple[bool, ...] | None = None  # per request (a paced cohort); None: every one may
    heads: bool = True                        # the heads may run for requests without a lookup draft
    # The heads rest long (draft_planner.PayGate.rests_long): a draft block may let its
    # context lapse rather than run it (vllm/block_context.py).
    long_rest: bool = False


@dataclass(frozen=True)
class Drafted:
    """What was drafted within the allowance, and what it took (by the rule's clock)."""

    offered: tuple[Candidate | None, ...] | None  # per request, its chain (None: none); None: nothing proposed
    heads_needed: bool = False      # a request that might draft had no lookup draft: the heads were wanted
    drafting_seconds: float = 0.0   # the heads' own time (0 where they did not run)
    proposal_seconds: float = 0.0   # from the allowance to here: lookup, heads, cuts


def whole_chains(drafted: Drafted) -> tuple[int, ...]:
    """Every offered chain sent whole."""
    if drafted.offered is None:
        return ()
    return tuple(0 if c is None else c.length for c in drafted.offered)


class DraftSizeRule(Protocol):
    name: str
    # Whether its answers follow from state one rank alone holds: then only rank 0 asks it.
    one_rank_decides: bool

    @property
    def clock(self) -> Callable[[], float]:
        """What the proposer times its drafting by: the clock the rule times steps by."""
        ...

    def before_drafting(self, view: StepView) -> Allowance: ...

    def after_drafting(self, drafted: Drafted) -> tuple[int, ...]:
        """Per request, how many of its offered drafts to send (empty where none were offered)."""
        ...

    def forget(self, req_id: str) -> None: ...

    def held_requests(self) -> set[str]: ...

    def describe(self) -> str:
        """One log line: what the rule drafts."""
        ...


class FixedDraftSize:
    """Whole drafts up to batch_backoff_start running requests; past it, per doubling of the
    batch, one chain token fewer and half the tree nodes."""

    name = "fixed"
    one_rank_decides = False  # the batch size alone decides: every rank answers alike

    def __init__(self, *, depth: int, max_tree_budget: int, batch_backoff_start: int) -> None:
        self.depth = depth
        self.max_tree_budget = max_tree_budget
        self.batch_backoff_start = batch_backoff_start

    @property
    def clock(self) -> Callable[[], float]:
        return time.perf_counter

    def _doublings_past_backoff(self, num_requests: int) -> int:
        start = self.batch_backoff_start
        return math.ceil(math.log2(num_requests / start)) if num_requests > start else 0

    def depth_for_batch(self, num_requests: int) -> int:
        return max(self.depth - self._doublings_past_backoff(num_requests), 0)

    def tree_budget_for_batch(self, num_requests: int) -> int:
        return max(self.max_tree_budget >> self._doublings_past_backoff(num_requests), 1)

    def before_drafting(self, view: StepView) -> Allowance:
        return Allowance(self.depth_for_batch(view.batch_size), self.tree_budget_for_batch(view.batch_size))

    def after_drafting(self, drafted: Drafted) -> tuple[int, ...]:
        return whole_chains(drafted)

    def forget(self, req_id: str) -> None:
        pass

    def held_requests(self) -> set[str]:
        return set()

    def describe(self) -> str:
        return (f"whole drafts up to {self.batch_backoff_start} running requests, one token fewer (half the tree "
                "nodes) per doubling past it")


class PlannedDraftSize:
    """The draft planner's lengths from batch_backoff_start running requests up (chains
    only); below it the fixed rule's whole drafts. Below the start a chain costs little next
    to the step and every whole chain pays on average (benchmarks/RESULTS.md, "The planner
    from the back-off start"), and the planner's gates, fed by timings that another
    process's work can skew for minutes, are not relied on there.

    pacing (SpecOptions.pace_cohorts): "default" paces a cohort with a sampled request, or a
    greedy one of GREEDY_PACED_FROM requests or more; "sampled", "always" or "never"."""

    name = "planned"
    # Steps are timed by this process's clock: rank 0's plan is every rank's.
    one_rank_decides = True

    def __init__(self, *, depth: int, max_tree_budget: int, batch_backoff_start: int, pacing: str = "default",
                 planner: DraftPlanner | None = None, log: Callable[[str], None] | None = None,
                 log_every_seconds: float = 60.0) -> None:
        self.depth = depth
        self.batch_backoff_start = batch_backoff_start
        self.whole = FixedDraftSize(depth=depth, max_tree_budget=max_tree_budget,
                                    batch_backoff_start=batch_backoff_start)
        self.planner = planner if planner is not None else DraftPlanner(depth)
        self.pacing = pacing
        self.pacer = CohortPacer() if pacing != "never" else None
        self.paced_steps = 0                        # steps paced so far
        self._paced: tuple[int, int] | None = None  # (may draft, running) at the last paced step
        self._planning: StepView | None = None      # the step under way, where the planner plans it
        self._log = log
        self._log_every_seconds = log_every_seconds
        self._logged_at = time.monotonic()

    @property
    def clock(self) -> Callable[[], float]:
        # Read at every step: what the planner compares drafting against is timed by its clock.
        return self.planner.clock

    def before_drafting(self, view: StepView) -> Allowance:
        if self.pacer is not None:
            self.pacer.step(view.req_ids)
        if view.batch_size < self.batch_backoff_start:
            self._planning = None
            self.planner.step_not_planned()
            return self.whole.before_drafting(view)
        self._planning = view
        batch, sampled = view.batch_size, any(view.sampled)
        self.planner.observe_step(view.req_ids, view.emitted, view.verified, view.sampled, timed=view.timed)
        if not self.planner.wants_proposal(batch, sampled):
            return Allowance(0, 0, long_rest=self.planner.heads_rest_long(batch, sampled))
        # Whether the heads are wanted is known only once prompt lookup has drafted (it may
        # draft for every request): the heads' gate is asked here without counting the step,
        # and counts it in after_drafting where they were wanted, as when it was asked then.
        heads = self.planner.heads_would_run(batch, sampled)
        return Allowance(self.depth, 0, self._may_draft(view), heads,
                         long_rest=not heads and self.planner.heads_rest_long(batch, sampled))

    def after_drafting(self, drafted: Drafted) -> tuple[int, ...]:
        view, self._planning = self._planning, None
        if view is None:
            return self.whole.after_drafting(drafted)
        batch, sampled = view.batch_size, any(view.sampled)
        if drafted.heads_needed:
            self.planner.wants_heads(batch, sampled)
        lengths: tuple[int, ...] = ()
        if drafted.offered is not None:
            planning_started = self.clock()
            lengths = tuple(self.planner.plan(view.req_ids, drafted.offered, sampled=sampled,
                                              drafting_seconds=drafted.drafting_seconds))
            self._log_now_and_then()
            self.planner.proposal_took(drafted.proposal_seconds + self.clock() - planning_started)
        # The drafts go to vLLM next: the step that verifies them starts now.
        self.planner.verify_started()
        return lengths

    def _may_draft(self, view: StepView) -> tuple[bool, ...] | None:
        """Which requests may draft this step: in a batch that started together (with a
        sampled request, or by default also a greedy one of GREEDY_PACED_FROM requests or
        more, or any with pacing='always'), those that have made the fewest tokens
        (cohort.py); None: all."""
        self._paced = None
        if self.pacer is None or view.budgets is None or not self.pacer.is_cohort:
            return None
        if self.pacing == "sampled" and not any(view.sampled):
            return None
        if self.pacing == "default" and not any(view.sampled) and view.batch_size < GREEDY_PACED_FROM:
            return None
        may = self.pacer.may_draft(view.budgets, slack=self.depth)
        self._paced = (sum(may), view.batch_size)
        self.paced_steps += 1
        return tuple(may)

    def _log_now_and_then(self) -> None:
        if self._log is None or time.monotonic() - self._logged_at < self._log_every_seconds:
            return
        self._logged_at = time.monotonic()
        paced = ("" if self._paced is None else
                 f"; the batch started together: {self._paced[0]} of {self._paced[1]} requests, those that "
                 "have made the fewest tokens, may draft")
        self._log(self.planner.describe() + paced)

    def forget(self, req_id: str) -> None:
        self.planner.forget(req_id)

    def held_requests(self) -> set[str]:
        return self.planner.held_requests()

    def describe(self) -> str:
        start = self.batch_backoff_start
        return (f"whole chains below {start} running requests; from {start} up, each request's drafts as far as "
                "their expected tokens are worth the verify time they add (measured while serving)")


def draft_size_rule(name: str, *, depth: int, max_tree_budget: int, batch_backoff_start: int,
                    pacing: str | None = None, log: Callable[[str], None] | None = None) -> DraftSizeRule:
    """The rule named by SpecOptions.draft_size. pacing: SpecOptions.pace_cohorts (None:
    "default" where the planner plans). log: where the planner's once-a-minute line goes."""
    if name == "fixed":
        if pacing not in (None, "never"):
            raise ConfigError(f"pace_cohorts={pacing!r} paces the planner's drafts, and this engine's draft size is "
                              f"{name!r}: give draft_size='planned', or pace_cohorts='never'")
        return FixedDraftSize(depth=depth, max_tree_budget=max_tree_budget, batch_backoff_start=batch_backoff_start)
    if name == "planned":
        return PlannedDraftSize(depth=depth, max_tree_budget=max_tree_budget, batch_backoff_start=batch_backoff_start,
                                pacing=pacing or "default", log=log)
    raise ConfigError(f"draft_size={name!r}: choose one of {DRAFT_SIZES}")
