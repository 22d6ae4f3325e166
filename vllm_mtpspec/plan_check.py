"""How far the draft planner's predictions for the drafts it sent were off, measured.

The planner sends the drafts whose predicted worth is highest, and a prediction that is
high by chance is the likeliest to be chosen: the estimates it leans on most are the ones
least measured (a calibration bin or a lookup depth still near its prior, a point of the
cost curve measured a few times on a fast stretch). So what it sent keeps fewer tokens,
and costs more time, than it predicted: in all seven planner traces kept in
benchmarks/results (two CPUs, batches 4 to 32, greedy and sampled), the drafts sent kept
4-27% fewer tokens than predicted and added 3-16% more time (once twice as much;
benchmarks/RESULTS.md, "The planner checks its own predictions"). A planner that
trusts its predictions drafts where drafting does not pay.

PlanCheck measures, per kind of batch, the tokens the sent drafts really kept against
those predicted, and the time they really added to the step against the time predicted,
as ratios over the recent sent steps, pulled towards 1 (a right prediction) by a few
pseudo-steps. The planner scales its next predictions by them: the kept chances by the
first, the time drafts add to a step by the second.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MeasuredRatio:
    """Decaying sums of what happened and of what was predicted, and their ratio, with
    prior_steps pseudo-steps at the mean prediction that came true."""

    decay: float
    prior_steps: float
    low: float
    high: float
    real: float = 0.0
    predicted: float = 0.0
    steps: float = 0.0

    def add(self, real: float, predicted: float) -> None:
        self.real = self.real * self.decay + real
        self.predicted = self.predicted * self.decay + predicted
        self.steps = self.steps * self.decay + 1.0

    @property
    def value(self) -> float:
        if self.steps <= 0 or self.predicted <= 0:
            return 1.0
        prior = self.prior_steps * self.predicted / self.steps
        return min(max((self.real + prior) / (self.predicted + prior), self.low), self.high)


class PlanCheck:
    """For one kind of batch: kept tokens and added seconds of sent drafts, real over
    predicted (the predictions as the planner made them before this correction)."""

    def __init__(self, *, decay: float = 0.99, prior_steps: float = 8.0) -> None:
        self.kept = MeasuredRatio(decay, prior_steps, low=0.25, high=2.0)
        # A step's time is noisy: one far faster than predicted must not make drafts free.
        self.added_seconds = MeasuredRatio(decay, prior_steps, low=0.5, high=4.0)

    def kept_chance(self, predicted: float) -> float:
        return min(predicted * self.kept.value, 1.0)

    def step_seconds(self, without_drafts: float, predicted: float) -> float:
        """A step predicted at `predicted` seconds, of which `without_drafts` it takes anyway."""
        return without_drafts + self.added_seconds.value * (predicted - without_drafts)

    def describe(self) -> str:
        return f"kept tokens x{self.kept.value:.2f}, added time x{self.added_seconds.value:.2f}"
