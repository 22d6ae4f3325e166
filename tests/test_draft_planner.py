"""The draft planner and the step-cost curve on synthetic machines: the cost of a step and
the chance of each draft being kept are known to the test, the planner sees only clocks,
path probabilities and emitted tokens."""
import itertools
import random

import pytest

from vllm_mtpspec.draft_planner import (
    Candidate,
    DraftPlanner,
    KeepCalibration,
    LookupKeepRates,
    PayGate,
    plan_drafts,
)
from vllm_mtpspec.plan_check import MeasuredRatio, PlanCheck
from vllm_mtpspec.step_cost import DecayingMean, StepCostCurve, StepCosts, non_decreasing


def brute_force_rate(keep_probs, step_seconds, drafting_seconds=0.0):
    """The best expected tokens per second over every allocation of draft lengths."""
    batch = len(keep_probs)
    best = 0.0
    for lengths in itertools.product(*(range(len(p) + 1) for p in keep_probs)):
        tokens = batch + sum(sum(p[:n]) for p, n in zip(keep_probs, lengths))
        d = sum(lengths)
        best = max(best, tokens / (step_seconds(batch + d) + (drafting_seconds if d else 0.0)))
    return best


def random_keep_probs(rng, batch, depth):
    out = []
    for _ in range(batch):
        reach, probs = 1.0, []
        for _ in range(rng.randint(0, depth)):
            reach *= rng.random()
            probs.append(reach)
        out.append(probs)
    return out


def random_cost_curve(rng):
    """A non-decreasing step cost with flat stretches and jumps, like a CPU's."""
    steps = [rng.choice([0.0, 0.0, rng.uniform(0, 0.5), rng.uniform(0.5, 2.0)]) for _ in range(20)]
    base = rng.uniform(0.5, 2.0)
    return lambda q: base + sum(steps[:q])


def test_the_plan_is_the_best_of_every_allocation_on_small_cases():
    rng = random.Random(0)
    for _ in range(300):
        keep = random_keep_probs(rng, rng.randint(1, 3), 3)
        cost = random_cost_curve(rng)
        drafting = rng.choice([0.0, rng.uniform(0, 0.5)])
        plan = plan_drafts(keep, cost, drafting_seconds=drafting)
        assert plan.tokens_per_second == pytest.approx(brute_force_rate(keep, cost, drafting), rel=1e-12)
        # And what it reports is what its lengths give.
        d = sum(plan.lengths)
        assert plan.expected_tokens == pytest.approx(len(keep) + sum(sum(p[:n]) for p, n in zip(keep, plan.lengths)))
        assert plan.seconds == pytest.approx(cost(len(keep) + d) + (drafting if d else 0.0))
        assert all(n <= len(p) for n, p in zip(plan.lengths, keep))


def test_verification_as_dear_as_decoding_drafts_nothing_and_free_verification_drafts_everything():
    keep = [[0.9, 0.8, 0.7], [0.5, 0.2, 0.1], [0.99, 0.98, 0.97]]
    as_dear_as_decoding = plan_drafts(keep, lambda q: 0.01 * q)
    assert as_dear_as_decoding.lengths == [0, 0, 0]
    free = plan_drafts(keep, lambda q: 0.05)
    assert free.lengths == [3, 3, 3]
    # Free verification, but drafting itself costs more than the drafts bring: none.
    assert plan_drafts(keep, lambda q: 0.05, drafting_seconds=1.0).lengths == [0, 0, 0]


def test_in_between_the_surest_drafts_go_first():
    keep = [[0.9, 0.8, 0.7], [0.3, 0.1, 0.05]]
    # Each extra query token costs 20% of a step without drafts: the first request's
    # drafts (0.9, 0.8, 0.7 kept) pay, the second's (0.3 first) do not.
    assert plan_drafts(keep, lambda q: 1.0 + 0.2 * (q - 2)).lengths == [3, 0]
    # At 40% only the surest draft pays: 2.9 tokens in 1.4 against 2 in 1 and 3.7 in 1.8.
    assert plan_drafts(keep, lambda q: 1.0 + 0.4 * (q - 2)).lengths == [1, 0]
    # The path probability never grows with depth: a larger later number is read as capped.
    assert plan_drafts([[0.2, 0.9]], lambda q: 1.0 + 0.5 * (q - 1)).lengths == [0]


def test_a_total_asked_for_takes_the_surest_drafts():
    keep = [[0.9, 0.8], [0.6, 0.1]]
    assert plan_drafts(keep, lambda q: 1.0, total=3).lengths == [2, 1]
    assert plan_drafts(keep, lambda q: 1.0, total=9).lengths == [2, 2]
    assert plan_drafts(keep, lambda q: 1.0, total=-1).lengths == [0, 0]


def test_decaying_mean_starts_at_the_first_sample_and_forgets_later():
    mean = DecayingMean(0.5)
    for x in (2.0, 4.0):
        mean.add(x)
    assert mean.value == pytest.approx((2.0 * 0.5 + 4.0) / 1.5)
    for _ in range(30):
        mean.add(10.0)
    assert mean.value == pytest.approx(10.0, abs=1e-6)


def test_the_cost_curve_fits_a_non_decreasing_line_through_its_measurements():
    assert non_decreasing([1.0, 3.0, 2.0, 4.0], [1, 1, 1, 1]) == [1.0, 2.5, 2.5, 4.0]
    assert non_decreasing([2.0, 1.0], [3, 1]) == [1.75, 1.75]
    curve = StepCostCurve()
    assert curve.seconds(4) is None and not curve.measured
    for q, s in ((4, 1.0), (8, 2.0), (16, 2.0)):
        curve.add(q, s)
    assert curve.seconds(6) == pytest.approx(1.5)
    assert curve.seconds(12) == pytest.approx(2.0)
    assert curve.seconds(64) == pytest.approx(2.0)   # above: flat until measured
    assert curve.seconds(2) == pytest.approx(0.5)    # below: in proportion
    # A stall (5x the usual) is dropped, a slower but plausible step is kept.
    assert not curve.add(8, 11.0) and curve.seconds(8) == pytest.approx(2.0)
    assert curve.add(8, 3.0) and curve.seconds(8) > 2.0


def test_batch_sizes_and_sampled_batches_are_measured_apart():
    costs = StepCosts()
    costs.curve(4, False).add(8, 1.0)
    assert costs.curve(5, False).seconds(8) == 1.0      # same power-of-two bucket
    assert costs.curve(8, False).seconds(8) is None
    assert costs.curve(4, True).seconds(8) is None


def test_keep_calibration_learns_what_the_target_keeps():
    calibration = KeepCalibration()
    assert calibration.keep_probability(0.75) == pytest.approx(0.75)  # nothing seen: the heads' word
    rng = random.Random(1)
    for _ in range(2000):  # drafts predicted at 0.7-0.8 are kept half the time
        calibration.observe(rng.uniform(0.7, 0.8), rng.random() < 0.5)
    assert calibration.keep_probability(0.75) == pytest.approx(0.5, abs=0.05)
    assert calibration.keep_probability(0.25) == pytest.approx(0.25)  # other bins untouched


def test_lookup_keep_rates_are_measured_depth_by_depth():
    rates = LookupKeepRates(3, prior=0.5)
    assert rates.keep_probs(3) == pytest.approx([0.5, 0.25, 0.125])
    for _ in range(3000):
        rates.observe(3, 1)   # always: depth 1 kept, depth 2 rejected, depth 3 never verified
    first, second, third = rates.keep_probs(3)
    assert first == pytest.approx(1.0, abs=0.02) and second == pytest.approx(0.0, abs=0.02)
    assert rates.keep_probs(9) == rates.keep_probs(3)  # no deeper than measured


class Machine:
    """A simulated engine: step cost by query tokens, heads whose path probability is
    right and whose run costs heads_seconds, and requests that keep each draft with that
    probability. modes: per step, the heads' acceptance profile is one of these, at random
    (confident on some text, unsure on other). claimed: the path probabilities the heads
    report instead, where they are wrong."""

    def __init__(self, step_seconds, *, batch_size, depth=3, seed=0, modes=((0.7, 0.6, 0.5),), noise=0.03,
                 heads_seconds=0.0, proposal_seconds=0.0, claimed=None):
        self.step_seconds = step_seconds
        self.batch_size = batch_size
        self.depth = depth
        self.rng = random.Random(seed)
        self.modes = modes
        self.noise = noise
        self.heads_seconds = heads_seconds
        self.proposal_seconds = proposal_seconds  # searching contexts and planning, every proposal
        self.claimed = claimed
        self.real_probs = []
        self.now = 0.0

    def candidates(self):
        accept = self.rng.choice(self.modes)
        out, self.real_probs = [], []
        for _ in range(self.batch_size):
            reach, probs = 1.0, []
            for m in range(self.depth):
                reach *= min(max(accept[m] + self.rng.uniform(-0.05, 0.05), 0.0), 1.0)
                probs.append(reach)
            self.real_probs.append(probs)
            out.append(Candidate("heads", False, self.depth, tuple(self.claimed or probs)))
        return out

    def run(self, planner, steps):
        req_ids = [f"r{i}" for i in range(self.batch_size)]
        emitted, verified = [1] * self.batch_size, None
        tokens = seconds = 0.0
        heads_runs = proposals = 0
        for step in range(steps):
            planner.observe_step(req_ids, emitted, verified, [False] * self.batch_size, timed=True)
            elapsed = 0.0
            candidates = [None] * self.batch_size
            lengths = [0] * self.batch_size
            if planner.wants_proposal(self.batch_size, False):
                proposals += 1
                elapsed += self.proposal_seconds
                if planner.wants_heads(self.batch_size, False):
                    heads_runs += 1
                    candidates = self.candidates()
                    elapsed += self.heads_seconds
                lengths = planner.plan(req_ids, candidates, sampled=False,
                                       drafting_seconds=self.heads_seconds if candidates[0] else 0.0)
                planner.proposal_took(elapsed)
                self.now += elapsed
            planner.verify_started()
            verify = self.step_seconds(self.batch_size + sum(lengths)) * (1 + self.rng.uniform(-self.noise, self.noise))
            self.now += verify
            elapsed += verify
            emitted = []
            for i, n in enumerate(lengths):
                probs, kept = self.real_probs[i] if n else [], 0
                while kept < n and self.rng.random() < probs[kept] / (probs[kept - 1] if kept else 1.0):
                    kept += 1
                emitted.append(1 + kept)
            verified = lengths
            if step >= steps // 2:
                tokens += sum(emitted)
                seconds += elapsed
        self.proposals = proposals
        return tokens / seconds, heads_runs


def best_fixed_rate(step_seconds, batch_size, modes=((0.7, 0.6, 0.5),), heads_seconds=0.0):
    """The best tokens per second of one chain length for every request and step."""
    best = batch_size / step_seconds(batch_size)
    for d in range(1, len(modes[0]) + 1):
        kept = 0.0
        for accept in modes:
            reach = 1.0
            for p in accept[:d]:
                reach *= p
                kept += reach / len(modes)
        best = max(best, batch_size * (1 + kept) / (step_seconds(batch_size * (1 + d)) + heads_seconds))
    return best


@pytest.mark.parametrize("name,step_seconds,batch_size", [
    ("free verification", lambda q: 0.05, 4),
    ("a CPU at batch 1", lambda q: 0.05 + 0.01 * (q - 1), 1),
    ("a GPU-like knee", lambda q: 0.02 + 0.002 * max(q - 16, 0), 8),
    ("a CPU: every token costs", lambda q: 0.01 + 0.004 * q, 16),
    ("compute bound", lambda q: 0.01 * q, 32),
])
def test_the_planner_reaches_the_best_fixed_plans_speed_on_a_simulated_machine(name, step_seconds, batch_size):
    machine = Machine(step_seconds, batch_size=batch_size)
    planner = DraftPlanner(3, clock=lambda: machine.now)
    rate, _ = machine.run(planner, 600)
    # Per-request plans can beat any one size for all: at least 95% of the best fixed one.
    assert rate >= 0.95 * best_fixed_rate(step_seconds, batch_size), name


def test_heads_that_pay_on_average_keep_running_through_unsure_stretches():
    # Batch 1, verification nearly free, the heads' run 12% of a step: on half the steps
    # the heads are unsure and no draft is worth its time, on the other half they are right.
    modes = ((0.9, 0.8, 0.7), (0.05, 0.02, 0.01))
    step_seconds = lambda q: 0.05 + 0.0005 * (q - 1)  # noqa: E731
    machine = Machine(step_seconds, batch_size=1, modes=modes, heads_seconds=0.006)
    planner = DraftPlanner(3, clock=lambda: machine.now)
    rate, heads_runs = machine.run(planner, 800)
    assert heads_runs > 0.9 * 800
    assert rate >= 0.95 * best_fixed_rate(step_seconds, 1, modes, heads_seconds=0.006)


def test_where_drafts_never_pay_the_heads_rest_except_to_check_again():
    machine = Machine(lambda q: 0.01 * q, batch_size=8, heads_seconds=0.002)
    planner = DraftPlanner(3, clock=lambda: machine.now, explore_every=32)
    _, heads_runs = machine.run(planner, 640)
    assert heads_runs <= 0.1 * 640  # the checks every explore_every steps, and the first runs


def test_where_no_draft_pays_for_the_proposals_own_time_the_proposer_rests_and_checks_again():
    # Many requests on a CPU: every query token costs, so drafts barely pay, while looking
    # for them (every context searched, a plan made) costs 4% of a step.
    step_seconds = lambda q: 0.01 * q  # noqa: E731
    machine = Machine(step_seconds, batch_size=32, modes=((0.3, 0.1, 0.05),), proposal_seconds=0.0128)
    planner = DraftPlanner(3, clock=lambda: machine.now, explore_every=32)
    rate, _ = machine.run(planner, 640)
    assert machine.proposals <= 0.1 * 640  # the first runs, then the checks every explore_every steps
    assert rate >= 0.98 * best_fixed_rate(step_seconds, 32)  # the speed of drafting nothing, within its checks


def test_heads_that_were_too_dear_for_a_while_come_back_when_they_pay_again():
    # A stretch where the heads cost as much as a step (a busy machine): they rest, and with
    # nothing else to draft the whole proposal rests too. Once they are cheap again, the
    # proposal's checks run them and both come back.
    step_seconds = lambda q: 0.05 + 0.0005 * (q - 1)  # noqa: E731
    machine = Machine(step_seconds, batch_size=1, heads_seconds=0.08, proposal_seconds=0.0005)
    planner = DraftPlanner(3, clock=lambda: machine.now, explore_every=32)
    _, dear = machine.run(planner, 400)
    assert dear < 0.25 * 400
    machine.heads_seconds = 0.002
    _, cheap_early = machine.run(planner, 1000)
    _, cheap = machine.run(planner, 400)
    assert cheap > 0.9 * 400, (dear, cheap_early, cheap)


def test_where_drafts_pay_for_the_proposal_it_keeps_running():
    step_seconds = lambda q: 0.05 + 0.0005 * (q - 1)  # noqa: E731
    machine = Machine(step_seconds, batch_size=4, proposal_seconds=0.004)
    planner = DraftPlanner(3, clock=lambda: machine.now)
    machine.run(planner, 400)
    assert machine.proposals == 400


def test_the_long_run_plan_weighs_tokens_against_what_the_engine_makes_meanwhile():
    rng = random.Random(3)
    for _ in range(300):
        keep = random_keep_probs(rng, rng.randint(1, 3), 3)
        cost = random_cost_curve(rng)
        rate = rng.uniform(0.5, 5.0)
        plan = plan_drafts(keep, cost, tokens_per_second=rate)
        best = max(len(keep) + sum(sum(p[:n]) for p, n in zip(keep, lengths)) - rate * cost(len(keep) + sum(lengths))
                   for lengths in itertools.product(*(range(len(p) + 1) for p in keep)))
        assert plan.expected_tokens - rate * plan.seconds == pytest.approx(best, rel=1e-9, abs=1e-12)
    # At lambda = the best ratio, the long-run plan is the best ratio's plan (Dinkelbach).
    keep = [[0.9, 0.8, 0.7], [0.3, 0.1, 0.05]]
    cost = lambda q: 1.0 + 0.2 * (q - 2)  # noqa: E731
    ratio = plan_drafts(keep, cost)
    assert plan_drafts(keep, cost, tokens_per_second=ratio.tokens_per_second).lengths == ratio.lengths


def test_what_was_kept_calibrates_the_heads_and_lookup_separately_by_kind():
    planner = DraftPlanner(3, clock=lambda: 0.0)
    heads = Candidate("heads", False, 3, (0.95, 0.75, 0.6))
    lookup = Candidate("lookup", True, 2)
    for _ in range(200):
        planner.observe_step(["a", "b"], [2, 1], [3, 2], [False, True], timed=False)
        lengths = planner.plan(["a", "b"], [heads, lookup], sampled=True)
        assert lengths == [3, 2]  # no step timed: the cost looks flat, everything is sent
    # Greedy heads drafts at 0.95 were kept, at 0.75 rejected, so the one at 0.6 was not
    # kept either; sampled ones unseen.
    assert planner.heads_keep[False].keep_probability(0.95) > 0.9
    assert planner.heads_keep[False].keep_probability(0.75) < 0.1
    assert planner.heads_keep[False].keep_probability(0.6) < 0.1
    assert planner.heads_keep[True].keep_probability(0.75) == pytest.approx(0.75)
    # Sampled lookup drafts were never kept; greedy lookup rates still the prior.
    assert planner.lookup_keep[True].keep_probs(1)[0] < 0.05
    assert planner.lookup_keep[False].keep_probs(1)[0] == pytest.approx(0.6)


def test_a_timed_step_lands_in_its_batchs_curve_by_its_query_tokens():
    now = [0.0]
    planner = DraftPlanner(3, clock=lambda: now[0])
    planner.plan(["a", "b"], [Candidate("lookup", False, 3), None], sampled=True)
    planner.verify_started()
    now[0] += 0.25
    planner.observe_step(["a", "b"], [1, 1], [3, 0], [False, True], timed=True)
    assert planner.costs.curve(2, True).samples(5) == 1 and planner.costs.curve(2, True).seconds(5) == 0.25
    # A step that also prefilled a prompt is not a verify step's time.
    planner.verify_started()
    now[0] += 9.0
    planner.observe_step(["a", "b"], [1, 1], [0, 0], [False, True], timed=False)
    assert planner.costs.curve(2, True).samples(2) == 0


def test_drafts_that_vllm_cut_count_only_as_far_as_they_were_verified():
    planner = DraftPlanner(3, clock=lambda: 0.0)
    planner.plan(["a"], [Candidate("lookup", False, 3)], sampled=False)
    planner.observe_step(["a"], [1], [0], [False], timed=False)  # vLLM verified none of the 3
    assert planner.lookup_keep[False].keep_probs(1)[0] == pytest.approx(0.6)


def test_a_measured_ratio_is_one_until_measured_then_real_over_predicted():
    ratio = MeasuredRatio(decay=1.0, prior_steps=8.0, low=0.25, high=2.0)
    assert ratio.value == 1.0
    ratio.add(1.0, 2.0)
    # One step at half its prediction, against 8 pseudo-steps that came true.
    assert ratio.value == pytest.approx((1.0 + 8 * 2.0) / (2.0 + 8 * 2.0))
    for _ in range(2000):
        ratio.add(1.0, 2.0)
    assert ratio.value == pytest.approx(0.5, abs=0.01)
    for _ in range(2000):
        ratio.add(-5.0, 1.0)  # a noisy clock can read a step faster than predicted
    assert ratio.value == 0.25


def test_what_sent_drafts_kept_and_cost_against_their_prediction_corrects_the_next_plans():
    now = [0.0]
    planner = DraftPlanner(3, clock=lambda: now[0])
    lookup = Candidate("lookup", False, 2)
    # A measured curve: 0.1 s for 2 query tokens, 0.15 s for 4; the engine's rate measured.
    for q, seconds in ((2, 0.1), (4, 0.15)):
        planner.costs.curve(2, False).add(q, seconds)
    planner.observe_step(["a", "b"], [1, 1], None, [False, False], timed=True)
    now[0] += 0.1
    planner.observe_step(["a", "b"], [1, 1], None, [False, False], timed=True)
    first = planner.plan(["a", "b"], [lookup, lookup], sampled=False)
    assert sum(first) > 0
    predicted = sum(sum(planner.keep_probs(lookup)[:n]) for n in first)
    predicted_added = planner.costs.curve(2, False).seconds(2 + sum(first)) - 0.1
    # The step keeps no draft and takes twice the time the drafts were predicted to add.
    planner.verify_started()
    now[0] += 0.1 + 2 * predicted_added
    planner.observe_step(["a", "b"], [1, 1], first, [False, False], timed=True)
    check = planner.checks[StepCosts.key(2, False)]
    assert check.kept.value == pytest.approx(8 * predicted / (predicted + 8 * predicted))
    assert check.added_seconds.value == pytest.approx((2 + 8) / (1 + 8))
    # The next plan expects its drafts' chances scaled by the measured ratio.
    heads = Candidate("heads", False, 1, (0.95,))
    assert planner.plan(["a", "b"], [heads, None], sampled=False) == [1, 0]
    assert planner.last.expected_tokens == pytest.approx(2 + 0.95 * check.kept.value)
    assert "kept tokens x0.89, added time x1.11" in planner.describe()


class FrozenCalibration(KeepCalibration):
    """Heads' probabilities trusted as they come: a bias in the predictions that the
    planner's calibration does not remove (as selection biases what is sent on real text)."""

    def observe(self, predicted, kept):
        pass


@pytest.mark.parametrize("check", [True, False])
def test_drafts_predicted_too_well_are_found_out_by_what_they_kept(check, monkeypatch):
    # A CPU where every query token costs: a draft pays only if kept more than 60% of the
    # time. The heads say 0.9 at every depth; the target keeps 0.4 of each.
    step_seconds = lambda q: 0.01 + 0.006 * q  # noqa: E731
    machine = Machine(step_seconds, batch_size=8, modes=((0.4, 0.4, 0.4),), claimed=(0.9, 0.81, 0.729))
    planner = DraftPlanner(3, clock=lambda: machine.now)
    planner.heads_keep = {False: FrozenCalibration(), True: FrozenCalibration()}
    if not check:
        monkeypatch.setattr(PlanCheck, "kept_chance", lambda self, p: p)
    rate, _ = machine.run(planner, 1200)
    nothing = 8 / step_seconds(8)
    if check:
        assert rate >= 0.97 * nothing
    else:
        assert rate < 0.9 * nothing  # what the planner did before it checked itself


def test_a_gate_that_keeps_not_paying_checks_ever_less_often_and_comes_back_at_once():
    gate = PayGate(explore_every=4, warmup_runs=8, decay=0.9, max_checks_apart=4)
    gate.record(1.0, 1.0)
    assert gate.wants(10.0)  # one run, a tenth of its cost: not yet sure, it runs again
    gate.record(1.0, 1.0)
    checks = []
    for step in range(60):
        if gate.wants(10.0):  # sure after two runs: it rests well before its eight warm-up runs
            checks.append(step)
            gate.record(1.0, 1.0)
    assert checks == [3, 7, 15, 31, 47], checks  # 4 apart, then 8, then 16 at most
    gate.record(100.0, 1.0)  # a check that paid: every step again, and checks 4 apart once it rests
    assert gate.wants(10.0) and gate.interval == 4


def test_a_gate_rests_long_only_after_checks_in_a_row_found_it_not_paying():
    gate = PayGate(explore_every=4, warmup_runs=1, decay=0.9, max_checks_apart=8)
    gate.record(1.0, 1.0)
    long_rest = []
    for step in range(40):
        if gate.wants(10.0):
            gate.record(1.0, 1.0)
        long_rest.append(gate.rests_long)
    # Checks at steps 3 (4 apart), 7 (then 8 apart), 15 (16) and 31 (32): the rest is long
    # once the next check is 16 steps off (four times explore_every), except at a check.
    assert [step for step, long in enumerate(long_rest) if long] == [s for s in range(8, 40) if s not in (15, 31)]
    gate.record(100.0, 1.0)  # a check that paid: no rest at all
    assert gate.wants(10.0) and not gate.rests_long
