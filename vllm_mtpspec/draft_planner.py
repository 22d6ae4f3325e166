"""How much each request drafts this step, from expected goodput.

A draft token pays when the accepted tokens it is expected to add are worth more than
the time it adds to the step that verifies it (SmartSpec, arXiv 2406.14066, plans the
same way). Every step the planner has, for each request, the chance that the target
keeps its first m drafts, for m = 1, 2, ...:
- heads' chains: the heads' own path probability (the product of each head's
  temperature-scaled top-1 probability), mapped through what the target really kept of
  earlier drafts with that predicted probability (KeepCalibration: the same heads accept
  less on new text than on their training data, and sampled requests keep drafts by a
  different law than greedy ones);
- prompt-lookup chains: the measured chance that lookup drafts are kept, depth by depth
  (LookupKeepRates).
and the measured cost of a verify step by its number of query tokens (step_cost.py).
Both are then corrected by how far the planner's predictions for the drafts it sent were
off (plan_check.py): what is chosen for looking best was, more often than not, predicted
too well.

What a step is worth is measured against what the engine makes anyway: lambda, its
measured tokens per second for this kind of batch (every request's own token included,
drafting and verifying included). A plan with D draft tokens in all is worth
(B + kept(D)) - lambda * step(B + D) tokens; the best plan maximises that (Dinkelbach's
form of maximising tokens per second over the long run, where one step's own ratio
would over-weigh the time already spent drafting). Because a request's chance of keeping
m drafts never grows with m, the best plan with D drafts is the D largest chances across
the batch, so one pass over D finds it; a request whose drafts are not worth it gets
none. The heads themselves run while what their drafts add, on average over the steps
of this kind of batch, is worth more than lambda times their own time; otherwise they
rest, and every `explore_every` steps they run once more to check. The whole proposal
(searching every context for prompt-lookup drafts, the heads, the plan) is gated the same
way by what any drafts add against its whole time, so that where nothing pays (many
requests on a CPU) the proposer costs what a rule that drafts nothing costs. Every `explore_every`
plans the planner also tries a plan half a token per request larger or smaller than the
best, so that the costs next to the chosen size stay measured. Which plan is taken never
changes what is generated: verification is lossless for any drafts.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vllm_mtpspec.plan_check import PlanCheck
from vllm_mtpspec.step_cost import DecayingMean, StepCosts


@dataclass(frozen=True)
class Plan:
    lengths: list[int]           # drafts sent, per request
    expected_tokens: float       # tokens the batch is expected to emit in the verify step
    seconds: float               # predicted time of that step (drafting included)

    @property
    def draft_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def tokens_per_second(self) -> float:
        return self.expected_tokens / max(self.seconds, 1e-12)


def plan_drafts(keep_probs: Sequence[Sequence[float]], step_seconds: Callable[[int], float], *,
                drafting_seconds: float = 0.0, tokens_per_second: float | None = None,
                total: int | None = None) -> Plan:
    """keep_probs[i][m - 1]: the chance that request i's first m drafts are all kept (made
    non-increasing in m here); step_seconds(q): a verify step of q query tokens.

    Returns the draft lengths with the most expected tokens per second in this step,
    counting every request's own token and `drafting_seconds` for any step that drafts;
    or, given tokens_per_second (lambda), the most expected tokens less lambda times the
    step's time. total: the number of draft tokens to send instead of the best
    (exploration)."""
    gains: list[tuple[float, int]] = []
    for i, probs in enumerate(keep_probs):
        reach = 1.0
        for p in probs:
            reach = min(reach, max(float(p), 0.0))
            gains.append((reach, i))
    gains.sort(key=lambda g: -g[0])  # stable: a request's shallower drafts stay first
    batch = len(keep_probs)

    def cost(d: int) -> float:
        return step_seconds(batch + d) + (drafting_seconds if d else 0.0)

    tokens = [float(batch)]
    for reach, _ in gains:
        tokens.append(tokens[-1] + reach)
    if total is None:
        if tokens_per_second is None:
            def worth(d: int) -> float:
                return tokens[d] / max(cost(d), 1e-12)
        else:
            def worth(d: int) -> float:
                return tokens[d] - tokens_per_second * cost(d)
        total = max(range(len(tokens)), key=lambda d: (worth(d), -d))
    total = min(max(total, 0), len(gains))
    lengths = [0] * batch
    for _, i in gains[:total]:
        lengths[i] += 1
    return Plan(lengths, tokens[total], cost(total))


class KeepCalibration:
    """What the target really keeps of drafts whose predicted path probability was p.

    Ten bins over [0, 1]; each holds the decaying share of drafts kept among those
    predicted in it, pulled towards the prediction itself by `prior_weight` pseudo-drafts
    (so an unseen bin trusts the heads)."""

    def __init__(self, *, bins: int = 10, prior_weight: float = 4.0, decay: float = 0.9995) -> None:
        self.bins = bins
        self.prior_weight = prior_weight
        self.decay = decay
        self._kept = [0.0] * bins
        self._seen = [0.0] * bins

    def _bin(self, p: float) -> int:
        return min(max(int(p * self.bins), 0), self.bins - 1)

    def keep_probability(self, predicted: float) -> float:
        b = self._bin(predicted)
        return (self._kept[b] + self.prior_weight * predicted) / (self._seen[b] + self.prior_weight)

    def observe(self, predicted: float, kept: bool) -> None:
        self._kept = [k * self.decay for k in self._kept]
        self._seen = [s * self.decay for s in self._seen]
        b = self._bin(predicted)
        self._kept[b] += float(kept)
        self._seen[b] += 1.0


class LookupKeepRates:
    """Measured chance that a prompt-lookup draft at depth m is kept once depths 1..m-1
    were, starting from `prior` worth `prior_weight` drafts."""

    def __init__(self, max_depth: int, *, prior: float = 0.6, prior_weight: float = 2.0, decay: float = 0.999) -> None:
        self.decay = decay
        self._kept = [prior * prior_weight] * max_depth
        self._seen = [prior_weight] * max_depth

    def keep_probs(self, length: int) -> list[float]:
        out, reach = [], 1.0
        for m in range(min(length, len(self._seen))):
            reach *= self._kept[m] / self._seen[m]
            out.append(reach)
        return out

    def observe(self, drafted: int, kept: int) -> None:
        # Depth m + 1 was reached (verified) when the m before it were kept.
        for m in range(min(drafted, kept + 1, len(self._seen))):
            self._kept[m] = self._kept[m] * self.decay + float(m < kept)
            self._seen[m] = self._seen[m] * self.decay + 1.0


class PayGate:
    """Whether a piece of drafting work pays for itself, for one kind of batch: while what
    it adds, on average over its runs, is worth more than the tokens the engine makes in its
    own time (lambda times its seconds). Otherwise it rests, and runs once in every
    `explore_every` steps to check again; a check that finds it still not paying puts the
    next one twice as far off, up to `max_checks_apart` times explore_every. Its first
    `warmup_runs` runs are made, unless after `sure_after` of them it adds less than a
    quarter of what the engine makes in its time. Once checks have put the next one
    `long_rest_checks_apart` times explore_every off or more, it rests long (`rests_long`).

    Why the checks thin out: a check runs the work for the whole batch, and where it never
    pays (many requests on a CPU) that is all it costs. At 64 requests on a 2-core CPU one
    run of the draft block, its rows held back since the last run included, took half a
    decode step and added about a twentieth of what the engine made meanwhile."""

    def __init__(self, *, explore_every: int, warmup_runs: int, decay: float, max_checks_apart: int = 8,
                 sure_after: int = 2, long_rest_checks_apart: int = 4) -> None:
        self.explore_every = explore_every
        self.warmup_runs = warmup_runs
        self.max_interval = explore_every * max_checks_apart
        self.long_interval = explore_every * long_rest_checks_apart
        self.sure_after = sure_after
        self.gain = DecayingMean(decay)      # tokens added per run
        self.seconds = DecayingMean(decay)   # the work's own time per run
        self.resting = 0                     # steps rested since it last paid
        self.checking = False                # the last `wants` is a run to check again
        self.interval = explore_every        # steps between checks while it rests

    def record(self, gain: float, seconds: float) -> None:
        self.gain.add(max(gain, 0.0))
        self.seconds.add(seconds)

    def pays(self, tokens_per_second: float) -> bool:
        return self.gain.value > tokens_per_second * self.seconds.value

    def _clearly_short(self, tokens_per_second: float) -> bool:
        """After sure_after runs, it adds less than a quarter of what it costs."""
        return (self.gain.samples >= self.sure_after
                and 4 * self.gain.value < tokens_per_second * self.seconds.value)

    def _asked(self, tokens_per_second: float | None) -> tuple[bool, int, bool, int]:
        """What `wants` answers now, and the resting count, checking flag and interval
        between checks it leaves."""
        if tokens_per_second is None or (self.gain.samples < self.warmup_runs
                                         and not self._clearly_short(tokens_per_second)):
            return True, self.resting, False, self.interval
        if self.pays(tokens_per_second):
            return True, 0, False, self.explore_every
        # The run just made was a check, and it still does not pay: the next comes later.
        interval = min(2 * self.interval, self.max_interval) if self.checking else self.interval
        resting = self.resting + 1
        checking = resting % interval == 0
        return checking, resting, checking, interval

    def would_want(self, tokens_per_second: float | None) -> bool:
        """What `wants` would answer now, without counting this step."""
        return self._asked(tokens_per_second)[0]

    def wants(self, tokens_per_second: float | None) -> bool:
        wanted, self.resting, self.checking, self.interval = self._asked(tokens_per_second)
        return wanted

    @property
    def rests_long(self) -> bool:
        """Checks in a row (two, by default) found it not paying, and the next is
        long_interval steps off or more. A short rest is not long: there a check after a few
        dozen steps may find the work paying again, and must see it as it would run."""
        return self.resting > 0 and not self.checking and self.interval >= self.long_interval


@dataclass(frozen=True)
class Candidate:
    """A request's draft as offered to the planner: where it came from, whether the request
    samples, and per draft token the heads' path probability (heads only)."""

    source: str                       # "heads" or "lookup"
    sampled: bool
    length: int
    path_probs: tuple[float, ...] = ()
    tokens: tuple[int, ...] = ()      # the draft itself (the planner reads only its length)


@dataclass
class _Sent:
    candidate: Candidate
    length: int
    predicted: tuple[float, ...]  # each draft's kept chance as predicted before the plan check


@dataclass(frozen=True)
class _SentStep:
    """What the plan predicted for the step that verifies its drafts, for the plan check."""

    key: tuple[int, bool]
    batch_size: int
    seconds_without_drafts: float
    added_seconds: float


@dataclass
class PlannerLog:
    """What the last plan chose and why (read by the once-a-minute log line)."""

    batch_size: int = 0
    sampled: bool = False
    draft_tokens: int = 0
    expected_tokens: float = 0.0
    seconds: float = 0.0
    seconds_without_drafts: float = 0.0
    explored: bool = False
    tokens_per_second: float | None = None
    heads_gain: float | None = None      # tokens the heads' drafts add per run, on average
    heads_cost: float | None = None      # tokens the engine makes in the heads' own time
    proposal_gain: float | None = None   # tokens any drafts add per proposal, on average
    proposal_cost: float | None = None   # tokens the engine makes in the proposal's own time
    check: str | None = None             # how the predictions are corrected (plan_check.py)


@dataclass
class DraftPlanner:
    max_depth: int
    explore_every: int = 32
    warmup_steps: int = 8        # heads runs of a kind of batch before they may rest
    rate_decay: float = 0.95
    clock: Callable[[], float] = time.perf_counter
    costs: StepCosts = field(default_factory=StepCosts)

    def __post_init__(self) -> None:
        self.heads_keep = {False: KeepCalibration(), True: KeepCalibration()}
        self.lookup_keep = {False: LookupKeepRates(self.max_depth), True: LookupKeepRates(self.max_depth)}
        self._sent: dict[str, _Sent] = {}
        self._verify_started: float | None = None
        self._observed_at: float | None = None
        Key = tuple[int, bool]
        self._tokens: dict[Key, DecayingMean] = {}       # tokens per step, decode-only steps
        self._seconds: dict[Key, DecayingMean] = {}      # their whole time, drafting included
        self._heads_gates: dict[Key, PayGate] = {}      # whether running the heads pays
        self._proposal_gates: dict[Key, PayGate] = {}   # whether proposing anything pays
        self.checks: dict[Key, PlanCheck] = {}           # how far sent drafts' predictions were off
        self._sent_step: _SentStep | None = None
        self._plans: dict[Key, int] = {}                 # plans made per kind of batch
        self._proposal_gain: tuple[tuple[int, bool], float] | None = None  # the last plan's, until timed
        self.last = PlannerLog()

    # -- what the step that just ended showed -------------------------------------------------
    def observe_step(self, req_ids: Sequence[str], emitted: Sequence[int], verified_drafts: Sequence[int] | None,
                     sampled: Sequence[bool], *, timed: bool) -> None:
        """Called before planning: the tokens each request emitted in the step that just
        ended, the drafts it verified (None: none), whether each samples, and whether the
        step decoded only (no prompt prefilled alongside, so its time is a verify step's)."""
        now = self.clock()
        started, self._verify_started = self._verify_started, None
        previous, self._observed_at = self._observed_at, now
        sent_step, self._sent_step = self._sent_step, None
        if timed and req_ids:
            key = StepCosts.key(len(req_ids), any(sampled))
            if started is not None:
                drafts = sum(verified_drafts) if verified_drafts is not None else 0
                self.costs.curve(len(req_ids), any(sampled)).add(len(req_ids) + drafts, now - started)
                if sent_step is not None and sent_step.batch_size == len(req_ids):
                    self.checks[sent_step.key].added_seconds.add(now - started - sent_step.seconds_without_drafts,
                                                                 sent_step.added_seconds)
            if previous is not None:
                self._tokens.setdefault(key, DecayingMean(self.rate_decay)).add(float(sum(emitted)))
                self._seconds.setdefault(key, DecayingMean(self.rate_decay)).add(now - previous)
        sent, self._sent = self._sent, {}
        if verified_drafts is None:
            return
        kept_in_all = predicted_in_all = 0.0
        for i, req in enumerate(req_ids):
            drafted = sent.get(req)
            if drafted is None:
                continue
            n = min(drafted.length, verified_drafts[i])
            kept = min(max(emitted[i] - 1, 0), n)
            kept_in_all += kept
            predicted_in_all += sum(drafted.predicted[:n])
            c = drafted.candidate
            if c.source == "lookup":
                self.lookup_keep[c.sampled].observe(n, kept)
            else:
                calibration = self.heads_keep[c.sampled]
                # Path probabilities are the chance of keeping every draft up to m + 1: a
                # draft after a rejected one counts as not kept.
                for m in range(n):
                    calibration.observe(c.path_probs[m], m < kept)
        if sent_step is not None and predicted_in_all > 0:
            self.checks[sent_step.key].kept.add(kept_in_all, predicted_in_all)

    def step_not_planned(self) -> None:
        """A step another rule drafted (a batch too small to plan): neither what was sent
        before nor the time since is matched to what the next planned step sees."""
        self._sent = {}
        self._sent_step = None
        self._verify_started = None
        self._observed_at = None

    def forget(self, req_id: str) -> None:
        self._sent.pop(req_id, None)

    def held_requests(self) -> set[str]:
        return set(self._sent)

    def verify_started(self) -> None:
        """Called when the drafts are handed to vLLM: the verify step's clock starts."""
        self._verify_started = self.clock()

    def tokens_per_second(self, batch_size: int, sampled: bool) -> float | None:
        """lambda: what the engine makes per second for this kind of batch, as measured."""
        key = StepCosts.key(batch_size, sampled)
        tokens, seconds = self._tokens.get(key), self._seconds.get(key)
        if tokens is None or seconds is None or seconds.value <= 0:
            return None
        return tokens.value / seconds.value

    # -- this step's plan ----------------------------------------------------------------------
    def _gate(self, gates: dict, batch_size: int, sampled: bool) -> PayGate:
        key = StepCosts.key(batch_size, sampled)
        if key not in gates:
            gates[key] = PayGate(explore_every=self.explore_every, warmup_runs=self.warmup_steps,
                                 decay=self.rate_decay)
        return gates[key]

    def wants_heads(self, batch_size: int, sampled: bool) -> bool:
        """Whether to run the heads this step: while their drafts add more, on average, than
        the engine makes in their own time; else every explore_every steps, to check. A
        resting proposal checked again runs them too: what it adds is then measured whole
        (with the heads resting as well, only lookup's gain would ever be seen)."""
        if self._gate(self._proposal_gates, batch_size, sampled).checking:
            return True
        return self._gate(self._heads_gates, batch_size, sampled).wants(self.tokens_per_second(batch_size, sampled))

    def heads_would_run(self, batch_size: int, sampled: bool) -> bool:
        """What wants_heads would answer now, without counting this step: asked before
        prompt lookup has shown whether any request needs the heads; wants_heads counts
        the step once one did."""
        if self._gate(self._proposal_gates, batch_size, sampled).checking:
            return True
        return self._gate(self._heads_gates, batch_size, sampled).would_want(
            self.tokens_per_second(batch_size, sampled))

    def heads_rest_long(self, batch_size: int, sampled: bool) -> bool:
        """Whether the heads rest long for this kind of batch: the proposal's gate or their
        own rests long (PayGate.rests_long)."""
        return (self._gate(self._proposal_gates, batch_size, sampled).rests_long
                or self._gate(self._heads_gates, batch_size, sampled).rests_long)

    def wants_proposal(self, batch_size: int, sampled: bool) -> bool:
        """Whether to propose at all this step (look up, run the heads, plan): while the
        drafts sent add more, on average, than the engine makes in the proposal's own time;
        else every explore_every steps, to check."""
        return self._gate(self._proposal_gates, batch_size, sampled).wants(
            self.tokens_per_second(batch_size, sampled))

    def proposal_took(self, seconds: float) -> None:
        """Called when a proposal is done (its drafts planned): its whole time."""
        if self._proposal_gain is None:
            return
        (batch_size, sampled), gain = self._proposal_gain
        self._proposal_gain = None
        gate = self._gate(self._proposal_gates, batch_size, sampled)
        gate.record(gain, seconds)
        rate = self.tokens_per_second(batch_size, sampled)
        self.last.proposal_gain = gate.gain.value
        self.last.proposal_cost = None if rate is None else rate * gate.seconds.value

    def plan(self, req_ids: Sequence[str], candidates: Sequence[Candidate | None], *, sampled: bool,
             drafting_seconds: float = 0.0) -> list[int]:
        """Draft lengths per request (candidates[i] None: nothing to offer). drafting_seconds:
        what running the heads took this step (0 when they rested)."""
        batch = len(req_ids)
        key = StepCosts.key(batch, sampled)
        check = self.checks.setdefault(key, PlanCheck())
        predicted = [self.keep_probs(c) if c is not None else [] for c in candidates]
        keep = [[check.kept_chance(p) for p in probs] for probs in predicted]
        curve = self.costs.curve(batch, sampled)
        without_drafts = curve.seconds(batch)  # None before anything is measured

        def seconds(q: int) -> float:
            # Before anything is measured, drafting everything is the first measurement.
            return 1.0 if without_drafts is None else check.step_seconds(without_drafts, curve.seconds(q))

        rate = self.tokens_per_second(batch, sampled) if curve.measured else None
        # The heads' time this step is spent whatever is sent: it does not enter the plan.
        best = plan_drafts(keep, seconds, tokens_per_second=rate)
        self._plans[key] = self._plans.get(key, 0) + 1
        explored = curve.measured and self._plans[key] % self.explore_every == 0
        plan = best
        if explored:
            step = max(1, batch // 2)
            wider = (self._plans[key] // self.explore_every) % 2 == 0
            plan = plan_drafts(keep, seconds, tokens_per_second=rate,
                               total=best.draft_tokens + (step if wider else -step))
        heads = self._gate(self._heads_gates, batch, sampled)
        heads_ran = any(c is not None and c.source == "heads" for c in candidates)
        if rate is not None:
            def worth(p: Plan) -> float:
                return p.expected_tokens - rate * p.seconds

            if heads_ran:
                # What the heads added: the best plan against the best without their drafts.
                without = plan_drafts([k if c is not None and c.source == "lookup" else []
                                       for k, c in zip(keep, candidates)], seconds, tokens_per_second=rate)
                heads.record(worth(best) - worth(without), drafting_seconds)
            # What drafting added at all: the best plan against sending nothing.
            self._proposal_gain = ((batch, sampled), worth(best) - worth(plan_drafts([[] for _ in keep], seconds,
                                                                        tokens_per_second=rate)))
        for req, c, n, chances in zip(req_ids, candidates, plan.lengths, predicted):
            if c is not None and n:
                self._sent[req] = _Sent(c, n, tuple(chances[:n]))
        if plan.draft_tokens and without_drafts is not None:
            self._sent_step = _SentStep(key, batch, without_drafts,
                                        curve.seconds(batch + plan.draft_tokens) - without_drafts)
        proposal = self._gate(self._proposal_gates, batch, sampled)
        self.last = PlannerLog(batch, sampled, plan.draft_tokens, plan.expected_tokens, plan.seconds,
                               without_drafts or 0.0, explored, rate,
                               heads.gain.value if heads.gain.samples else None,
                               rate * heads.seconds.value if heads.gain.samples and rate is not None else None,
                               proposal.gain.value if proposal.gain.samples else None,
                               rate * proposal.seconds.value if proposal.gain.samples and rate is not None else None,
                               check.describe())
        return plan.lengths

    def keep_probs(self, candidate: Candidate) -> list[float]:
        if candidate.source == "lookup":
            return self.lookup_keep[candidate.sampled].keep_probs(candidate.length)
        calibration = self.heads_keep[candidate.sampled]
        return [calibration.keep_probability(p) for p in candidate.path_probs[:candidate.length]]

    def describe(self) -> str:
        """One log line: what the last plan chose and why."""
        last = self.last
        kind = "with sampled requests" if last.sampled else "greedy"
        rate = "not yet measured" if last.tokens_per_second is None else f"{last.tokens_per_second:.1f} tokens/s"
        why = "" if last.check is None else f"; what sent drafts did against their predictions: {last.check}"
        if last.heads_gain is not None and last.heads_cost is not None:
            why += (f"; the heads' drafts add {last.heads_gain:.2f} tokens a run against {last.heads_cost:.2f} made "
                    f"in their own time ({'running' if last.heads_gain > last.heads_cost else 'resting'})")
        if last.proposal_gain is not None and last.proposal_cost is not None:
            why += (f"; any drafts add {last.proposal_gain:.2f} tokens a proposal against {last.proposal_cost:.2f} "
                    f"made in its own time ({'proposing' if last.proposal_gain > last.proposal_cost else 'resting'})")
        if not last.draft_tokens:
            return (f"{last.batch_size} running requests ({kind}, engine at {rate}): drafting nothing; a step without "
                    f"drafts is measured at {1e3 * last.seconds_without_drafts:.1f} ms and no draft was expected to "
                    f"pay for the time it adds{why}")
        return (f"{last.batch_size} running requests ({kind}, engine at {rate}): drafting {last.draft_tokens} tokens "
                f"({last.draft_tokens / last.batch_size:.2f} per request{', exploring' if last.explored else ''}), "
                f"expected {last.expected_tokens / last.batch_size:.2f} tokens per request in a step predicted at "
                f"{1e3 * last.seconds:.1f} ms (without drafts {1e3 * last.seconds_without_drafts:.1f} ms){why}")
