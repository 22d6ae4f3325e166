"""The states entering a decoder's layers (EAGLE-3's features): what vLLM returns as
aux_hidden_states for the same layers (the residual stream before layer l: the token
embeddings for layer 0), recorded from a Hugging Face decoder with forward pre-hooks.

A draft block that reads them takes them beside the final state as one row per
position, [final; entering l_1; ...; entering l_n] ([T, (1 + n) d]), so that whatever
picks a request's rows (accepted tree nodes, a request's share of a batch) picks both.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where used: the command line reads this module too
    import torch


def stored_layer_states(states: "torch.Tensor") -> "torch.Tensor":
    """States entering layers as training data keeps them: in bf16, not fp16. They are the
    unnormalized residual stream, whose values fp16 cannot hold in every model (Gemma 3
    270M's reach 1e5 past its ninth layer; fp16 stops at 65,504), and a drafter reads them
    through an RMSNorm, which bf16's coarser rounding leaves intact to a part in 256."""
    import torch

    return states.to(torch.bfloat16)


@contextmanager
def recording_layer_inputs(decoder, layers: list[int], *, whole_batch: bool = False):
    """Yields a dict that the forward passes run inside fill: layer -> [T, d], the state
    entering that layer for the first sequence of the batch (the last pass's); with
    whole_batch, [B, T, d] for every sequence."""
    seen: dict[int, "torch.Tensor"] = {}

    def recorder(layer):
        def record(_module, args, kwargs):
            states = args[0] if args else kwargs["hidden_states"]
            seen[layer] = states if whole_batch else states[0]
        return record

    handles = [decoder.layers[layer].register_forward_pre_hook(recorder(layer), with_kwargs=True) for layer in layers]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def with_layer_states(final: torch.Tensor, entering: list[torch.Tensor]) -> torch.Tensor:
    """[T, d] final states and n [T, d] layer inputs -> [T, (1 + n) d] rows."""
    import torch

    return torch.cat([final, *[state.to(final.dtype) for state in entering]], -1) if entering else final


def split_layer_states(rows: torch.Tensor, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[T, (1 + n) d] rows -> (final [T, d], layer inputs [T, n, d] or None where n = 0)."""
    if rows.shape[-1] == hidden_size:
        return rows, None
    return rows[..., :hidden_size], rows[..., hidden_size:].unflatten(-1, (-1, hidden_size))


def parse_layer_list(text: str) -> list[int]:
    """'2,15,27' -> [2, 15, 27] (a command line's --feature-layers)."""
    import argparse

    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give layer indices separated by commas, e.g. 2,15,27") from None
