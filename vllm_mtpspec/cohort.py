"""Pacing a batch whose requests all started together: only the ones behind draft.

The draft planner values every emitted token at what the engine makes per second, which
is right where a request that finishes early makes room for a waiting one. A batch whose
requests all started together and that nobody joins (`LLM.generate` on a list of
prompts, or a burst of requests) ends when its last request does. There a request that
drafts ahead of the others does not shorten the run: it leaves the batch a few steps
sooner, saving only its own share of the steps it skips, while the drafts it sent made
steps of the whole batch longer. Worse, requests that drift apart leave a tail of steps
with few requests, each costing almost what a full step costs (measured: at 32 requests
on a 2-core CPU half the decode time went to that tail; benchmarks/RESULTS.md).

So while the running requests form a cohort (every one of them joined within
`join_window` steps of the others, all with the same max_tokens), only those that have
made the fewest tokens (within `slack` of the furthest behind) may draft; the others wait
for them. A batch that new requests keep joining, or whose requests have different or
unknown token budgets, is not paced: there which request ends last is not known (a
server fills in max_tokens from each prompt's length, and answers end at EOS). The
proposer paces batches with a sampled request by default (pace_cohorts): greedy drafts,
prompt lookup's above all, come in bursts that a request ahead banks cheaply against
stretches it cannot guess, and pacing them measured slower.
"""
from __future__ import annotations

from collections.abc import Sequence

# Left unset, pace_cohorts paces sampled batches and greedy ones of at least this many
# requests (benchmarks/RESULTS.md). Side by side on a 2-core Xeon with AMX, greedy batches of
# 32 and 64 read 1.03x and 1.00x of vLLM alone paced, against 0.93x and 0.92x unpaced; at 16
# the two were level (0.94x, 0.95x). On a 2-core AMD EPYC with AVX2 only, greedy 16 read
# 0.95x paced against 0.85x unpaced. Below 16, pacing was level with unpaced or behind it on
# both CPUs (at 4: 1.05x against 1.13x on the Xeon).
GREEDY_PACED_FROM = 16


class CohortPacer:
    def __init__(self, *, join_window: int = 16) -> None:
        self.join_window = join_window
        self._step = 0
        self._joined: dict[str, int] = {}

    def step(self, req_ids: Sequence[str]) -> None:
        """Called every step with the running requests: who joined when."""
        self._step += 1
        running = set(req_ids)
        self._joined = {r: s for r, s in self._joined.items() if r in running}
        for r in req_ids:
            self._joined.setdefault(r, self._step)

    @property
    def is_cohort(self) -> bool:
        """The running requests all joined within join_window steps of each other."""
        if len(self._joined) < 2:
            return False
        joined = self._joined.values()
        return max(joined) - min(joined) <= self.join_window

    def may_draft(self, budgets: Sequence[tuple[int, int] | None], *, slack: int) -> list[bool]:
        """Per request (budgets: its max_tokens and the tokens it has made; None where it has
        no max_tokens), whether it may draft this step: all of them unless the batch is a
        cohort with one max_tokens; there, those within `slack` tokens of the one that has
        made the fewest."""
        if not self.is_cohort or any(b is None for b in budgets) or len({b[0] for b in budgets}) > 1:
            return [True] * len(budgets)
        fewest = min(made for _, made in budgets)
        return [made <= fewest + slack for _, made in budgets]
