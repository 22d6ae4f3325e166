"""How much to draft per step, learned while serving.

Drafting pays only while verifying the extra tokens costs less than the tokens they
save, and where that line lies depends on the machine (a GPU verifies 8 tokens for about
the price of 1; two CPU cores pay ~2x), on the batch (a large batch is compute bound
already), on the heads and on the text. A fixed rule gets some of these wrong, so the
controller measures them. Each draft size is a *level*: 0 drafts nothing, higher levels
draft longer chains (or larger trees). For every level it keeps

- the tokens a request emits in a step drafted at that level (accepted drafts plus the
  target's own token), pooled over batch sizes: acceptance depends on the text, not on
  the batch. Where levels are nested (a chain of j tokens is the first j tokens of a
  longer one), one step at level L also says what every level below L would have
  emitted, so the longest chains teach all the shorter ones;
- the wall time of such a step, per batch-size bucket (powers of two), measured from
  one draft proposal to the next, so it holds drafting, verification, sampling and
  vLLM's own per-step work. Steps that also prefilled a prompt are not timed.

Each step it takes the level with the most tokens per second for the current batch,
but leaves the level it is on only for one measured to be `switch_margin` better: step
times on a shared machine are noisy, and flapping between two near-equal levels costs
more than either. Levels not yet timed in a bucket are tried first (a few steps each),
and every `explore_every` steps a neighbour of the best level is timed again, so the
figures follow the machine's load and the text. Which level is chosen never changes what is
generated: verification is lossless at every level.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass
class DecayingMean:
    """A mean that forgets: weights decay by `decay` per added sample."""

    decay: float
    value: float = 0.0
    weight: float = 0.0
    samples: int = 0

    def add(self, x: float, weight: float = 1.0) -> None:
        self.weight = self.weight * self.decay + weight
        self.value += (x - self.value) * weight / self.weight
        self.samples += 1


class DraftSizeController:
    """Chooses a level in 0..max_level per step from measured tokens per second."""

    def __init__(self, max_level: int, *, nested: bool = False, explore_every: int = 16, min_samples: int = 3,
                 switch_margin: float = 0.03, time_decay: float = 0.9, token_decay: float = 0.995,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if max_level < 0:
            raise ValueError(f"max_level={max_level}: must be >= 0")
        self.max_level = max_level
        self.nested = nested
        self.explore_every = explore_every
        self.min_samples = min_samples
        self.switch_margin = switch_margin
        self._clock = clock
        self._time_decay = time_decay
        # Tokens per request, pooled over batch sizes; level 0 always emits exactly one.
        self._tokens = [DecayingMean(token_decay) for _ in range(max_level + 1)]
        self._seconds: dict[int, list[DecayingMean]] = {}  # bucket -> per level
        self._steps: dict[int, int] = {}  # bucket -> steps chosen there
        self._explored: dict[int, int] = {}  # bucket -> explorations made there
        self._current: dict[int, int] = {}  # bucket -> the level it is on
        self._pending: tuple[float, int, int] | None = None  # (started, bucket, level)

    def next_level(self, batch_size: int, emitted: Sequence[int], timed: bool) -> int:
        """The level for the step about to be drafted for `batch_size` requests.

        emitted: tokens each request of the previous drafted batch emitted in the step
        that just ended (requests new to the batch left out); timed: whether that step is
        fit to be timed (decode only, no prompt prefilled alongside)."""
        now = self._clock()
        self._record(now, emitted, timed)
        if batch_size <= 0:
            self._pending = None
            return 0
        bucket = batch_size.bit_length()
        level = self._choose(bucket)
        self._pending = (now, bucket, level)
        return level

    def tokens_per_second(self, batch_size: int) -> dict[int, float]:
        """What is known for a batch of this size: level -> tokens per second (for logs)."""
        bucket = batch_size.bit_length()
        seconds = self._seconds.get(bucket, [])
        return {level: batch_size * self._expected_tokens(level) / s.value
                for level, s in enumerate(seconds) if s.samples and s.value > 0}

    def _record(self, now: float, emitted: Sequence[int], timed: bool) -> None:
        if self._pending is None:
            return
        started, bucket, level = self._pending
        self._pending = None
        if not emitted:
            return
        for lower in range(1 if self.nested else level, level + 1):
            if lower > 0:  # at `lower`, a request emits at most lower + 1 tokens
                capped = sum(min(e, lower + 1) for e in emitted)
                self._tokens[lower].add(capped / len(emitted), weight=len(emitted))
        if timed:
            seconds = self._bucket(bucket)[level]
            elapsed = now - started
            # A step far slower than this level's usual is a stall (another process, a
            # collection), not a property of the level.
            if not seconds.samples or elapsed < 5 * seconds.value:
                seconds.add(elapsed)

    def _bucket(self, bucket: int) -> list[DecayingMean]:
        if bucket not in self._seconds:
            self._seconds[bucket] = [DecayingMean(self._time_decay) for _ in range(self.max_level + 1)]
        return self._seconds[bucket]

    def expected_tokens(self, level: int) -> float:
        """Tokens a request emits per step at this level, as measured (1.0 before any)."""
        return self._expected_tokens(level)

    def _expected_tokens(self, level: int) -> float:
        mean = self._tokens[level]
        return mean.value if level > 0 and mean.samples else 1.0

    def _choose(self, bucket: int) -> int:
        seconds = self._bucket(bucket)
        for level, s in enumerate(seconds):
            if s.samples < self.min_samples:
                return level
        rates = [self._expected_tokens(level) / max(s.value, 1e-9) for level, s in enumerate(seconds)]
        best = max(range(len(rates)), key=rates.__getitem__)
        current = self._current.get(bucket, best)
        if rates[best] <= rates[current] * (1 + self.switch_margin):
            best = current
        self._current[bucket] = best
        self._steps[bucket] = self._steps.get(bucket, 0) + 1
        if self.max_level and self._steps[bucket] % self.explore_every == 0:
            # A neighbour, below and above in turn: cheap (far levels are the costly
            # ones to try) and enough to climb to a better level step by step.
            self._explored[bucket] = self._explored.get(bucket, 0) + 1
            step = -1 if self._explored[bucket] % 2 else 1
            neighbour = best + step
            return neighbour if 0 <= neighbour <= self.max_level else best - step
        return best
