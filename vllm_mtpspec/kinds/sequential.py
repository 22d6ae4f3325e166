"""Sequential heads (sequential_heads.py): depth i is an MLP on depth i - 1's state and the
token drafted from it, as Hydra's heads are."""
from __future__ import annotations

from dataclasses import dataclass

from vllm_mtpspec.kinds.base import DrafterKind


@dataclass(frozen=True, kw_only=True)
class SequentialKind(DrafterKind):
    def seeded_from(self, heads):
        """Full-precision tied parallel heads seed every depth with their head 1
        (SequentialHeads.from_parallel)."""
        from vllm_mtpspec.heads import MTPHeads
        from vllm_mtpspec.sequential_heads import SequentialHeads

        if type(heads) is not MTPHeads or not heads.config.tied:
            return None
        return SequentialHeads.from_parallel(heads)


SEQUENTIAL = SequentialKind(
    name="sequential",
    label="sequential heads",
    row_tag="sequential",
    noun="sequential heads",
    module="vllm_mtpspec.sequential_heads:SequentialHeads",
    chains_only=True,
    grows_trees=True,
    reads_drafted_tokens=True,
    tied_only=True,
    token_conditioned_only=True,
)
