"""Drafter kinds: one module per kind (what it is and can do), one table (registry.py).

    from vllm_mtpspec.kinds import kind_of
    kind_of(heads.config).grows_trees

A new kind is a module declaring a DrafterKind and a `register_kind` call; nothing outside
this folder names a kind.
"""
from vllm_mtpspec.kinds.attention import ATTENTION
from vllm_mtpspec.kinds.base import DrafterKind, resolve
from vllm_mtpspec.kinds.eagle3 import EAGLE3
from vllm_mtpspec.kinds.parallel import PARALLEL
from vllm_mtpspec.kinds.registry import (
    UnknownKindError,
    kind_named,
    kind_names,
    kind_of,
    register_kind,
    unregister_kind,
)
from vllm_mtpspec.kinds.sequential import SEQUENTIAL

# The default kind (a config without head_kind) is the first one.
DEFAULT_KIND = PARALLEL.name
for _kind in (PARALLEL, SEQUENTIAL, ATTENTION, EAGLE3):
    register_kind(_kind)

__all__ = ["ATTENTION", "DEFAULT_KIND", "EAGLE3", "PARALLEL", "SEQUENTIAL", "DrafterKind", "UnknownKindError", "kind_named",
           "kind_names", "kind_of", "register_kind", "resolve", "unregister_kind"]
