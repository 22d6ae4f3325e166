"""After a tree step: move the accepted nodes' KV to the slots of their final positions.

Node j of a tree was written to the slot of sequential position root + j + 1 (its own
slot) but attended as position root + depth. Once a path of a nodes is accepted, the
request continues at root + a + 1, and vLLM expects positions root + 1 .. root + a to
hold that path: the d-th accepted node moves to the slot of root + d. Rejected nodes'
slots lie beyond the new sequence end and are overwritten later, as vLLM does with
rejected chain drafts. A destination may be another move's source, so every layer
reads all sources before it writes any destination.
"""
from __future__ import annotations

from typing import Sequence

import torch

from vllm_mtpspec.verify import Verdict
from vllm_mtpspec.vllm.attention import BlockLayout
from vllm_mtpspec.vllm.tree_step import TreeStep


def compaction_moves(step: TreeStep, verdicts: dict[int, Verdict], query_start_loc: Sequence[int]
                     ) -> tuple[list[int], list[int]]:
    """-> (source, destination) token indices into the step's flattened query tokens."""
    sources, destinations = [], []
    for tree in step.trees:
        verdict = verdicts.get(tree.batch_index)
        if verdict is None:
            continue
        root = query_start_loc[tree.batch_index + 1] - tree.num_query_tokens
        for depth, node in enumerate(verdict.accepted_nodes, start=1):
            if node + 1 != depth:
                sources.append(root + 1 + node)
                destinations.append(root + depth)
    return sources, destinations


def move_kv(kv_caches: Sequence[torch.Tensor], layout: BlockLayout, slot_mapping: torch.Tensor,
            sources: list[int], destinations: list[int]) -> None:
    """Copy keys and values from the sources' slots to the destinations' slots, every layer."""
    if not sources:
        return
    bs = layout.block_size
    src = slot_mapping[torch.tensor(sources)].long()
    dst = slot_mapping[torch.tensor(destinations)].long()
    # Flat offsets inside a block-head of every element of each token: [m, 2 * D].
    elements = torch.cat([layout.key_index, layout.value_index], dim=1)
    src_elems, dst_elems = elements[src % bs], elements[dst % bs]
    src_blocks, dst_blocks = (src // bs)[:, None], (dst // bs)[:, None]
    seen: set[int] = set()
    for kv_cache in kv_caches:
        if kv_cache is None or id(kv_cache) in seen:
            continue
        seen.add(id(kv_cache))
        flat = kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], -1)   # [num_blocks, H, bs * 2D]
        moved = flat[src_blocks, :, src_elems]                            # [m, 2D, H]
        flat[dst_blocks, :, dst_elems] = moved
