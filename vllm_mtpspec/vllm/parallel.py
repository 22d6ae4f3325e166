"""Decisions that every tensor-parallel rank must take alike.

With tensor parallelism each rank builds its own proposer, and the heads' projection
(`compute_logits`) and embedding are collectives: ranks that draft different sizes would
hang or gather mismatched tensors, and verify by different rules. Anything a proposer
decides from state one rank alone holds (its clock, by which the draft planner times
steps) is decided on rank 0 of the tensor-parallel group and broadcast; what follows from
state every rank holds (the batch, the hidden states, the drafts) needs no sharing.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol


class BroadcastGroup(Protocol):
    """What is used of vLLM's GroupCoordinator (vllm.distributed.parallel_state)."""

    world_size: int
    rank_in_group: int

    def broadcast_object(self, obj: Any | None = None, src: int = 0) -> Any: ...


def tensor_parallel_group() -> BroadcastGroup | None:
    """vLLM's tensor-parallel group, or None outside a distributed vLLM worker."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tp_group()


class RankZeroDecision:
    """decide() runs on rank 0 only; every rank returns rank 0's answer."""

    def __init__(self, group: BroadcastGroup | None) -> None:
        self.group = group if group is not None and group.world_size > 1 else None

    @property
    def decides_here(self) -> bool:
        return self.group is None or self.group.rank_in_group == 0

    def __call__(self, decide: Callable[[], Any]) -> Any:
        if self.group is None:
            return decide()
        return self.group.broadcast_object(decide() if self.decides_here else None, src=0)
