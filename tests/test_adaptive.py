"""The draft-size controller against simulated machines: a step's cost and a level's
acceptance are known to the simulation, the controller only sees clocks and tokens."""
import random

import pytest

from vllm_mtpspec.adaptive import DecayingMean, DraftSizeController


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


# Heads like the shipped ones: the chance that draft j is accepted once drafts 1..j-1 were.
ACCEPT = [0.4, 0.375, 0.45]


def accepted_length(level):
    """Mean tokens a request emits per step with a chain of `level` drafts."""
    total, reach = 1.0, 1.0
    for p in ACCEPT[:level]:
        reach *= p
        total += reach
    return total


def simulate(step_seconds, *, batch_size, steps=400, max_level=3, seed=0, noise=0.05):
    """Runs the controller on chains; returns how often each level was chosen over the
    last half, and the tokens per second it reached there as a share of the best fixed
    level's. step_seconds(batch_size, level) describes the machine; each step's time gets
    multiplicative noise, each request's accepted drafts are drawn draft by draft."""
    rng = random.Random(seed)
    clock = FakeClock()
    controller = DraftSizeController(max_level, nested=True, clock=clock)
    chosen = [0] * (max_level + 1)
    emitted: list[int] = []
    tokens, seconds = 0, 0.0
    for step in range(steps):
        level = controller.next_level(batch_size, emitted, timed=True)
        emitted = []
        for _ in range(batch_size):
            accepted = 0
            while accepted < level and rng.random() < ACCEPT[accepted]:
                accepted += 1
            emitted.append(1 + accepted)
        elapsed = step_seconds(batch_size, level) * (1 + rng.uniform(-noise, noise))
        clock.now += elapsed
        if step >= steps // 2:
            chosen[level] += 1
            tokens, seconds = tokens + sum(emitted), seconds + elapsed
    best = max(batch_size * accepted_length(lv) / step_seconds(batch_size, lv) for lv in range(max_level + 1))
    return chosen, tokens / seconds / best


def test_free_verification_drafts_the_most():
    """A GPU-like machine at batch 1: verifying 4 tokens costs about what 1 does."""
    chosen, share = simulate(lambda b, level: 0.010 * (1 + 0.01 * level), batch_size=1)
    assert chosen[2] + chosen[3] > 0.9 * sum(chosen)  # levels 2 and 3 are within 4% of each other
    assert share > 0.95


def test_compute_bound_batches_stop_drafting():
    """Each extra token costs as much as the batch's own: drafting only loses."""
    chosen, share = simulate(lambda b, level: 0.001 * b * (1 + level), batch_size=64)
    assert chosen[0] > 0.8 * sum(chosen)
    assert share > 0.95


def test_the_best_middle_level_wins_where_costs_grow():
    """Costs that grow with the draft (a CPU at a small batch): one draft token pays,
    three do not (tokens per second: level 0: 1.0, 1: 1.17, 2: 1.11, 3: 0.92)."""
    chosen, share = simulate(lambda b, level: 0.1 * (1 + 0.2 * level + 0.1 * level * level), batch_size=4)
    assert max(range(4), key=chosen.__getitem__) == 1
    assert share > 0.95


def test_batch_sizes_are_measured_apart():
    clock = FakeClock()
    controller = DraftSizeController(1, clock=clock)
    emitted = []
    for step in range(400):
        batch = 1 if step % 2 else 64
        level = controller.next_level(batch, emitted, timed=True)
        emitted = [1 + level] * batch  # every draft accepted
        clock.now += (0.01 if batch == 1 else 0.64 * (1 + 2 * level))  # drafting triples a batch-64 step
    assert controller.current_level(1) == 1
    assert controller.current_level(64) == 0


def test_each_batch_size_starts_from_the_prior_and_a_right_prior_costs_little():
    """Starting where the fixed back-off would (no drafts for 64 requests), the
    controller stays there, and its checks of the level above grow rare."""
    clock = FakeClock()
    controller = DraftSizeController(3, prior=lambda batch_size: 0 if batch_size >= 64 else 3, clock=clock)
    levels, emitted = [], []
    for _ in range(2000):
        level = controller.next_level(64, emitted, timed=True)
        levels.append(level)
        emitted = [1 + min(level, 1)] * 64
        clock.now += 0.064 * (1 + level)
    assert levels[0] == 0 and controller.current_level(64) == 0
    assert sum(1 for level in levels[1000:] if level) < 0.02 * 1000
    assert controller.current_level(1) is None  # no batch of 1 seen yet


def test_untimed_steps_and_stalls_leave_the_step_times_alone():
    clock = FakeClock()
    controller = DraftSizeController(1, clock=clock, min_samples=1)
    controller.next_level(1, [], timed=True)          # level 1 pending
    clock.now += 0.1
    assert controller.next_level(1, [2], timed=True) == 1  # times it
    before = controller.tokens_per_second(1)
    assert before == pytest.approx({1: 20.0})
    clock.now += 5.0                                  # a prefill (untimed)
    controller.next_level(1, [2], timed=False)
    clock.now += 50.0                                 # a stall, far beyond the usual
    controller.next_level(1, [2], timed=True)
    assert controller.tokens_per_second(1) == pytest.approx(before)


def test_exploration_revisits_a_neighbour_of_the_best():
    clock = FakeClock()
    controller = DraftSizeController(3, clock=clock, explore_every=4)
    levels, emitted = [], []
    for _ in range(100):
        level = controller.next_level(1, emitted, timed=True)
        levels.append(level)
        emitted = [1 + level]  # every draft accepted, steps cost the same: level 3 is best
        clock.now += 0.1
    tail = levels[50:]
    assert tail.count(3) >= 0.7 * len(tail)
    assert set(tail) == {2, 3}, "the level below the best is timed again now and then, the far ones not"


def test_a_long_chain_says_what_the_shorter_ones_would_have_emitted():
    def after_a_level_3_step(nested):
        clock = FakeClock()
        controller = DraftSizeController(3, nested=nested, clock=clock)
        assert controller.next_level(3, [], timed=True) == 3  # no prior given: the longest chain
        clock.now += 0.1
        controller.next_level(3, [4, 1, 2], timed=True)  # what the level-3 step emitted
        return controller

    nested = after_a_level_3_step(nested=True)
    assert nested.expected_tokens(3) == pytest.approx(7 / 3)
    assert nested.expected_tokens(2) == pytest.approx((3 + 1 + 2) / 3)  # level 2 would have emitted 3, 1, 2
    assert nested.expected_tokens(1) == pytest.approx((2 + 1 + 2) / 3)
    assert after_a_level_3_step(nested=False).expected_tokens(2) == 1.0  # not measured


def test_decaying_mean_starts_at_the_first_sample_and_forgets_later():
    mean = DecayingMean(0.5)
    for x in (2.0, 4.0):
        mean.add(x)
    assert mean.value == pytest.approx((2.0 * 0.5 + 4.0) / 1.5)
    for _ in range(30):
        mean.add(10.0)
    assert mean.value == pytest.approx(10.0, abs=1e-6)


def test_nothing_to_choose_from_and_empty_batches():
    controller = DraftSizeController(0, clock=FakeClock())
    assert all(controller.next_level(8, [1] * 8, timed=True) == 0 for _ in range(20))
    assert DraftSizeController(2, clock=FakeClock()).next_level(0, [], timed=True) == 0
    with pytest.raises(ValueError, match="max_level"):
        DraftSizeController(-1)
