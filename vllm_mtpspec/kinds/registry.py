"""The table of drafter kinds: a heads config's `head_kind` -> its DrafterKind.

The built-in kinds register themselves when the package `vllm_mtpspec.kinds` is imported
(its __init__); another kind registers from anywhere with `register_kind`, before heads of
that kind are loaded (in vLLM: in the process that builds the engine's workers).
"""
from __future__ import annotations

from vllm_mtpspec.kinds.base import DrafterKind

_KINDS: dict[str, DrafterKind] = {}


class UnknownKindError(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def register_kind(kind: DrafterKind, *, replace: bool = False) -> DrafterKind:
    """Adds a kind to the table; a second kind of the same name is refused unless `replace`."""
    if kind.name in _KINDS and _KINDS[kind.name] is not kind and not replace:
        raise ValueError(f"a drafter kind named {kind.name!r} is already registered; give another name, or "
                         "replace=True")
    _KINDS[kind.name] = kind
    return kind


def unregister_kind(name: str) -> None:
    _KINDS.pop(name, None)


def kind_names() -> tuple[str, ...]:
    """The registered kinds' names, in the order they were registered."""
    return tuple(_KINDS)


def kind_named(name: str) -> DrafterKind:
    try:
        return _KINDS[name]
    except KeyError:
        raise UnknownKindError(f"head_kind={name!r}: choose one of {kind_names()}") from None


def kind_of(config) -> DrafterKind:
    """The kind of a heads config (anything with a `head_kind`)."""
    return kind_named(config.head_kind)
