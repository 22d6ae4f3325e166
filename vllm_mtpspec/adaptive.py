"""How much to draft per step, learned while serving.

Drafting pays only while verifying the extra tokens costs less than the tokens they
save, and where that line lies depends on the machine (a GPU verifies 8 tokens for about
the price of 1; two CPU cores pay ~2x), on the batch (a large batch is compute bound
already), on the heads and on the text. A fixed rule gets some of these wrong, so the
controller measures them. Each draft size is a *level*: 0 drafts nothing, higher levels
draft longer chains (or larger trees). It keeps

- the tokens a request emits in a step drafted at each level (accepted drafts plus the
  target's own token), pooled over batch sizes: acceptance depends on the text, not on
  the batch. Where levels are nested (a chain of j tokens is the first j tokens of a
  longer one), one step at level L also says what every level below L would have
  emitted;
- the wall time of a step at each level, per batch-size bucket (powers of two), measured
  from one draft proposal to the next, so it holds drafting, verification, sampling and
  vLLM's own per-step work. Steps that also prefilled a prompt are not timed.

In each bucket it starts from a prior level (the fixed back-off's choice) and climbs:
now and then it plays a neighbouring level for a short burst of steps (so the two are
compared under nearly the same load; earlier bursts still weigh in, decaying) and moves
there if that level gave `switch_margin` more tokens per second. A burst that finds nothing better doubles the wait before the next one, so a
level that is right costs almost nothing to keep checking. Which level is chosen never
changes what is generated: verification is lossless at every level.
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


@dataclass
class _Bucket:
    """What the controller knows and does for one batch-size bucket."""

    seconds: list[DecayingMean]   # step time per level
    current: int                  # the level it is on
    wait: int                     # steps on `current` before the next burst
    steps: int = 0                # steps on `current` since the last burst
    bursts: int = 0               # bursts made (their direction alternates)
    burst_level: int | None = None
    burst_samples_at_start: int = 0
    burst_steps: int = 0


class DraftSizeController:
    """Chooses a level in 0..max_level per step from measured tokens per second."""

    def __init__(self, max_level: int, *, prior: Callable[[int], int] | None = None, nested: bool = False,
                 explore_every: int = 16, max_wait: int = 512, min_samples: int = 3, switch_margin: float = 0.03,
                 time_decay: float = 0.9, token_decay: float = 0.995,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if max_level < 0:
            raise ValueError(f"max_level={max_level}: must be >= 0")
        self.max_level = max_level
        self.nested = nested
        self.explore_every = explore_every
        self.max_wait = max_wait
        self.min_samples = min_samples
        self.switch_margin = switch_margin
        self._prior = prior or (lambda batch_size: max_level)
        self._clock = clock
        self._time_decay = time_decay
        # Tokens per request, pooled over batch sizes; level 0 always emits exactly one.
        self._tokens = [DecayingMean(token_decay) for _ in range(max_level + 1)]
        self._buckets: dict[int, _Bucket] = {}
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
        key = batch_size.bit_length()
        level = self._choose(self._bucket(key, batch_size))
        self._pending = (now, key, level)
        return level

    def expected_tokens(self, level: int) -> float:
        """Tokens a request emits per step at this level, as measured (1.0 before any)."""
        mean = self._tokens[level]
        return mean.value if level > 0 and mean.samples else 1.0

    def tokens_per_second(self, batch_size: int) -> dict[int, float]:
        """What is known for a batch of this size: level -> tokens per second (for logs)."""
        bucket = self._buckets.get(batch_size.bit_length())
        if bucket is None:
            return {}
        return {level: batch_size * self.expected_tokens(level) / s.value
                for level, s in enumerate(bucket.seconds) if s.samples and s.value > 0}

    def current_level(self, batch_size: int) -> int | None:
        """The level a bucket has settled on (None before it has seen a batch this size)."""
        bucket = self._buckets.get(batch_size.bit_length())
        return None if bucket is None else bucket.current

    def _record(self, now: float, emitted: Sequence[int], timed: bool) -> None:
        if self._pending is None:
            return
        started, key, level = self._pending
        self._pending = None
        if not emitted:
            return
        for lower in range(1 if self.nested else level, level + 1):
            if lower > 0:  # at `lower`, a request emits at most lower + 1 tokens
                capped = sum(min(e, lower + 1) for e in emitted)
                self._tokens[lower].add(capped / len(emitted), weight=len(emitted))
        if timed:
            seconds = self._buckets[key].seconds[level]
            elapsed = now - started
            # A step far slower than this level's usual is a stall (another process, a
            # collection), not a property of the level.
            if not seconds.samples or elapsed < 5 * seconds.value:
                seconds.add(elapsed)

    def _bucket(self, key: int, batch_size: int) -> _Bucket:
        if key not in self._buckets:
            start = min(max(self._prior(batch_size), 0), self.max_level)
            self._buckets[key] = _Bucket([DecayingMean(self._time_decay) for _ in range(self.max_level + 1)],
                                         current=start, wait=self.explore_every)
        return self._buckets[key]

    def _rate(self, bucket: _Bucket, level: int) -> float:
        return self.expected_tokens(level) / max(bucket.seconds[level].value, 1e-9)

    def _choose(self, bucket: _Bucket) -> int:
        if bucket.burst_level is not None:
            level = bucket.burst_level
            new_samples = bucket.seconds[level].samples - bucket.burst_samples_at_start
            # Untimed steps (a prefill) do not count; a burst gives up after a while.
            if new_samples < self.min_samples and bucket.burst_steps < 3 * self.min_samples:
                bucket.burst_steps += 1
                return level
            self._settle(bucket, level, timed_enough=new_samples >= self.min_samples)
        if bucket.seconds[bucket.current].samples < self.min_samples or not self.max_level:
            return bucket.current
        bucket.steps += 1
        if bucket.steps < bucket.wait:
            return bucket.current
        # A burst on a neighbour, below and above in turn.
        bucket.steps = 0
        bucket.bursts += 1
        step = -1 if bucket.bursts % 2 else 1
        neighbour = bucket.current + step
        if not 0 <= neighbour <= self.max_level:
            neighbour = bucket.current - step
        bucket.burst_level = neighbour
        bucket.burst_samples_at_start = bucket.seconds[neighbour].samples
        bucket.burst_steps = 1
        return neighbour

    def _settle(self, bucket: _Bucket, level: int, *, timed_enough: bool) -> None:
        bucket.burst_level = None
        if timed_enough and self._rate(bucket, level) > self._rate(bucket, bucket.current) * (1 + self.switch_margin):
            bucket.current = level
            bucket.wait = self.explore_every
        else:
            bucket.wait = min(2 * bucket.wait, self.max_wait)
