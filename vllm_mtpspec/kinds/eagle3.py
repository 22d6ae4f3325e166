"""EAGLE-3's draft layer (eagle3_layer.py): what vLLM's own `eagle3` method computes, with
the draft block's cache, chains, dynamic trees, copy bias and planner. It reads the states
entering its feature layers (not the final state) and drafts through its own LM head over a
draft vocabulary (published checkpoints, eagle3_format.py), or through the target's rows
where tied."""
from __future__ import annotations

from dataclasses import dataclass

from vllm_mtpspec.kinds.base import DrafterKind


@dataclass(frozen=True, kw_only=True)
class Eagle3Kind(DrafterKind):
    def initial_heads(self, model, model_dir, *, num_heads: int, seed: int, tied: bool = True,
                      head_input: str = "hidden", mlp_size: int = 0, init_std: float = 0.0,
                      feature_layers: list[int] = ()):
        """A layer shaped as the model's own, reading feature_layers (default: vLLM's three)."""
        from vllm_mtpspec.heads_init import init_eagle3_layer

        return init_eagle3_layer(model, model_dir, num_heads=num_heads, seed=seed, feature_layers=feature_layers,
                                 tied=tied)


EAGLE3 = Eagle3Kind(
    name="eagle3",
    label="EAGLE-3 layer",
    row_tag="eagle3",
    noun="EAGLE-3 layers",
    module="vllm_mtpspec.eagle3_layer:Eagle3Layer",
    chains_only=True,
    grows_trees=True,
    keeps_context=True,
    reads_layers=True,
    takes_copy_bias=True,
    stock_vllm_method="eagle3",
    reference_drafter="vllm_mtpspec.drafter:BlockDrafter",
    needs_block_shape=True,
    own_head_vocabulary=True,
    shape_fields=("feature_layers",),
    quantize_aware_training=False,
    # Trained as the block is (whole answers with their prompt rows, each depth fed its own
    # output: EAGLE-3's training-time test), through the target's LM head.
    trains_tied_only=True,
    training_module="vllm_mtpspec_train.modules:BlockModule",
    online_training_module="vllm_mtpspec_train.modules:OnlineBlockModule",
)
