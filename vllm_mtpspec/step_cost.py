"""What a verify step costs on this machine, as measured while serving.

The draft planner (draft_planner.py) weighs each draft token's expected gain against the
time it adds to the step that verifies it. That time depends on the machine (a GPU
verifies 8 tokens for about the price of 1, two CPU cores pay ~2x), the model, the dtype
and the batch, so it is measured, never assumed: for each batch-size bucket (powers of
two: per-request work grows with the batch) and each kind of batch (one with a sampled
request pays the rejection sampler), the wall time of every decode-only step by the
number of query tokens it verified (each request's own token plus its drafts).

Between measured points the curve is the non-decreasing fit of the measured means (a
step does not get cheaper by verifying more tokens), interpolated linearly. Outside them
it leans towards what has not been tried, so that planning explores: above the largest
measured size it stays flat (more drafts look free until measured) and below the
smallest it shrinks in proportion (fewer tokens look cheaper), so the plans that follow
measure both sides.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass
class DecayingMean:
    """A mean that forgets: weights decay by `decay` per added sample."""

    decay: float
    value: float = 0.0
    weight: float = 0.0
    samples: int = 0

    def add(self, x: float) -> None:
        self.weight = self.weight * self.decay + 1.0
        self.value += (x - self.value) / self.weight
        self.samples += 1


class StepCostCurve:
    """Seconds of a verify step by its number of query tokens, for one kind of batch."""

    def __init__(self, *, decay: float = 0.9, stall_factor: float = 5.0) -> None:
        self.decay = decay
        self.stall_factor = stall_factor
        self._means: dict[int, DecayingMean] = {}
        self._fit: tuple[list[int], list[float]] | None = None

    def add(self, query_tokens: int, seconds: float) -> bool:
        """Records one step; False where it was dropped as a stall (another process, a
        garbage collection): far slower than this size's usual."""
        usual = self.seconds(query_tokens)
        if usual is not None and seconds > self.stall_factor * usual:
            return False
        self._means.setdefault(query_tokens, DecayingMean(self.decay)).add(seconds)
        self._fit = None
        return True

    @property
    def measured(self) -> bool:
        return bool(self._means)

    @property
    def steps(self) -> int:
        """Steps measured, all sizes together."""
        return sum(mean.samples for mean in self._means.values())

    def samples(self, query_tokens: int) -> int:
        mean = self._means.get(query_tokens)
        return 0 if mean is None else mean.samples

    def seconds(self, query_tokens: int) -> float | None:
        """The predicted time of a step of this many query tokens (None before any step)."""
        if not self._means:
            return None
        xs, ys = self.fit()
        if query_tokens >= xs[-1]:
            return ys[-1]
        if query_tokens <= xs[0]:
            return ys[0] * max(query_tokens, 0) / xs[0]
        j = bisect.bisect_right(xs, query_tokens)
        x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
        return y0 + (y1 - y0) * (query_tokens - x0) / (x1 - x0)

    def fit(self) -> tuple[list[int], list[float]]:
        """The measured sizes and their non-decreasing fitted times."""
        if self._fit is None:
            xs = sorted(self._means)
            ys = non_decreasing([self._means[x].value for x in xs], [self._means[x].weight for x in xs])
            self._fit = (xs, ys)
        return self._fit


def non_decreasing(values: list[float], weights: list[float]) -> list[float]:
    """The weighted least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [weighted sum, weight, count]
    for v, w in zip(values, weights):
        w = max(w, 1e-12)
        blocks.append([v * w, w, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, weight, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += weight
            blocks[-1][2] += count
    return [total / weight for total, weight, count in blocks for _ in range(int(count))]


class StepCosts:
    """One curve per (batch-size bucket, whether a request in the batch samples)."""

    def __init__(self, **curve_options) -> None:
        self._curve_options = curve_options
        self._curves: dict[tuple[int, bool], StepCostCurve] = {}

    @staticmethod
    def key(batch_size: int, sampled: bool) -> tuple[int, bool]:
        return batch_size.bit_length(), sampled

    def curve(self, batch_size: int, sampled: bool) -> StepCostCurve:
        key = self.key(batch_size, sampled)
        if key not in self._curves:
            self._curves[key] = StepCostCurve(**self._curve_options)
        return self._curves[key]
