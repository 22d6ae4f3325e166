"""The module for each head kind (config.HEAD_KINDS), built from a heads config."""
from __future__ import annotations

from vllm_mtpspec.config import HeadsConfig
from vllm_mtpspec.heads import DraftModule, MTPHeads


def build_heads(config: HeadsConfig) -> DraftModule:
    if config.head_kind == "attention":
        from vllm_mtpspec.draft_block import DraftBlock

        return DraftBlock(config)
    if config.head_kind == "sequential":
        from vllm_mtpspec.sequential_heads import SequentialHeads

        return SequentialHeads(config)
    return MTPHeads(config)
