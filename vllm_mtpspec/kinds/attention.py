"""The attention draft block (draft_block.py): one transformer layer with causal attention
over the context's features, applied recursively on its own output for deeper drafts (as
EAGLE and DeepSeek-V3's MTP module are). It keeps an entry for every position of the
context, grows dynamic trees from its own drafts, may read other layers' states and takes
a copy bias."""
from __future__ import annotations

from dataclasses import dataclass

from vllm_mtpspec.kinds.base import DrafterKind


@dataclass(frozen=True, kw_only=True)
class AttentionKind(DrafterKind):
    def initial_heads(self, model, model_dir, *, num_heads: int, seed: int, tied: bool = True,
                      head_input: str = "hidden", mlp_size: int = 0, init_std: float = 0.0,
                      feature_layers: list[int] = ()):
        """A block shaped as one of the model's own layers; mlp_size (0: the layer's) sets
        its MLP's width, which is most of its weights."""
        from vllm_mtpspec.heads_init import init_draft_block

        return init_draft_block(model, model_dir, num_heads=num_heads, seed=seed, feature_layers=list(feature_layers),
                                mlp_size=mlp_size)


ATTENTION = AttentionKind(
    name="attention",
    label="draft block",
    row_tag="block",
    noun="the draft block's states",
    module="vllm_mtpspec.draft_block:DraftBlock",
    chains_only=True,
    grows_trees=True,
    keeps_context=True,
    reads_layers=True,
    takes_copy_bias=True,
    reference_drafter="vllm_mtpspec.drafter:BlockDrafter",
    needs_block_shape=True,
    tied_only=True,
    shape_fields=("feature_layers",),
    sizes_block_mlp=True,
    # Quantization-aware steps train MLP heads only so far; int2_method 'gptq-refit'
    # calibrates the block's INT2 copy on whole answers instead.
    quantize_aware_training=False,
    training_module="vllm_mtpspec_train.modules:BlockModule",
    online_training_module="vllm_mtpspec_train.modules:OnlineBlockModule",
)
