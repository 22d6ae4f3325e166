"""Parallel heads (heads.py): every depth is an MLP on h_t (and the token x_{t+1}), so all
depths draft at once and any tree shape can be chosen among their candidates."""
from vllm_mtpspec.kinds.base import DrafterKind

PARALLEL = DrafterKind(
    name="parallel",
    label="parallel heads",
    noun="parallel heads",
    module="vllm_mtpspec.heads:MTPHeads",
)
