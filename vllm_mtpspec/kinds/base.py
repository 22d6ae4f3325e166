"""DrafterKind: what one kind of drafter is and can do, declared in one place.

A kind is a `DrafterKind` instance in a module of this folder (one module per kind),
registered in the table (registry.py). The rest of the package asks the kind of a heads
config what it can do (`kind_of(config).grows_trees`) and never tests a kind's name, so a
new kind is one module and one `register_kind` call.

This module imports nothing of the package: the heads config validates a kind through the
table, and a kind builds the heads modules that read that config, so what a kind builds
with is named by where it lives ("package.module:Name") and imported when it runs.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


def resolve(path: str | Any) -> Any:
    """"package.module:Attribute" -> the attribute (anything else is returned as it is)."""
    if not isinstance(path, str):
        return path
    module, _, attribute = path.partition(":")
    found = importlib.import_module(module)
    for part in attribute.split("."):
        found = getattr(found, part)
    return found


@dataclass(frozen=True, kw_only=True)
class DrafterKind:
    # The value of a heads config's `head_kind`, and what the kind's drafts are called in
    # logs and reports.
    name: str
    label: str
    # What tells a benchmark row of this kind apart from other kinds' rows ("" for the default).
    row_tag: str = ""
    # The torch module that drafts, built as module(config): a class, or where it lives
    # ("package.module:Class") so that the table loads no torch module until one is built.
    module: Any
    # What its noun is in a refusal ("sequential heads project ...").
    noun: str = ""

    # -- what it drafts -------------------------------------------------------------------
    # Its deeper drafts read the shallower ones' tokens, so each depth's logits are those
    # along its own top-1 chain: no fixed-shape tree applies, and none can be replayed.
    chains_only: bool = False
    # Its dynamic trees are grown depth by depth from its own drafts (grown_tree.py) rather
    # than chosen among every depth's candidates (tree.py).
    grows_trees: bool = False
    # It keeps entries for every position of a request's context (an attention block):
    # its training shards carry the prompt rows, it trains and is scored on whole answers
    # read with their prompt, and served it keeps its own cache and context store.
    keeps_context: bool = False
    # Each depth reads the token drafted before it (not only the one just sampled): trained
    # and scored on the answer's own tokens along a chain that is still right.
    reads_drafted_tokens: bool = False
    # It may read the states entering other target layers (block.feature_layers).
    reads_layers: bool = False
    # Its chains take a copy bias toward what the context repeats (copy_bias.py).
    takes_copy_bias: bool = False
    # The method of stock vLLM that serves this kind exported (None: the plugin alone serves it).
    stock_vllm_method: str | None = None
    # What the reference decoder (reference.py) drafts with, built as drafter(heads, model).
    reference_drafter: str = "vllm_mtpspec.drafter:HeadsDrafter"

    # -- what its config must say ---------------------------------------------------------
    needs_block_shape: bool = False       # a `block` shape (BlockConfig), which only it has
    tied_only: bool = False               # it projects through the target's LM head
    # Untied, its own LM head's rows are its draft vocabulary (EAGLE-3's d2t maps them to
    # target ids); other untied heads draft over the whole vocabulary.
    own_head_vocabulary: bool = False
    token_conditioned_only: bool = False  # it reads the sampled token (head_input="hidden+token")

    # -- how it is trained ----------------------------------------------------------------
    # The training job's fields that fix its shape (an earlier run to train further must match).
    shape_fields: tuple[str, ...] = ("head_input", "mlp_size")
    # The job's mlp_size sets its block's MLP width (0: the target layer's), where it has a block.
    sizes_block_mlp: bool = False
    # Quantization-aware steps can train its INT2 copy.
    quantize_aware_training: bool = True
    # The training job trains it tied to the target's LM head only (an LM head of its own is
    # written out on export).
    trains_tied_only: bool = False
    # Where its training modules live (the library declares, the training job imports): on
    # recorded shards, and on answers each worker runs the target over itself (None: the
    # training job does not train this kind).
    training_module: str | None = "vllm_mtpspec_train.modules:PosthocModule"
    online_training_module: str | None = "vllm_mtpspec_train.modules:PosthocModule"

    def refusal(self, config) -> str | None:
        """Why a heads config cannot be of this kind (None: it can): the field and the fix."""
        if self.needs_block_shape != (config.block is not None):
            return (f"head_kind={self.name!r} with block={'set' if config.block else 'unset'}: an attention draft "
                    "block or layer needs its 'block' shape, and only they have one")
        if self.tied_only and not config.tied:
            return (f"head_kind={self.name!r} with tied=false: {self.noun} project through the target's LM head; "
                    "set tied=true")
        if self.token_conditioned_only and config.head_input != "hidden+token":
            return (f"head_kind={self.name!r} with head_input={config.head_input!r}: {self.noun} read the token "
                    "drafted before them; set head_input='hidden+token'")
        if config.copy_bias is not None and not self.takes_copy_bias:
            return (f"copy_bias with head_kind={self.name!r}: only an attention draft block's chains take a copy "
                    "bias; remove copy_bias")
        return None

    def tree_refusal(self, tree: str) -> str | None:
        """Why this kind cannot draft the tree preset `tree` (None: it can)."""
        if tree in ("chain", "dynamic") or not self.chains_only:
            return None
        return (f"head_kind={self.name!r} drafts chains and dynamic trees only (its deeper drafts read the "
                "shallower ones' tokens, so each node's children come from a draft step of its own)")

    @property
    def default_tree(self) -> str:
        """The tree preset it drafts best when none is asked: a consensus tree from
        independent heads, a tree grown step by step from heads that read their own drafts."""
        return "dynamic" if self.chains_only else "consensus"

    def build(self, config):
        """The drafting module for a heads config of this kind (weights as initialised)."""
        return resolve(self.module)(config)

    def initial_heads(self, model, model_dir, *, num_heads: int, seed: int, tied: bool = True,
                      head_input: str = "hidden", mlp_size: int = 0, init_std: float = 0.0,
                      feature_layers: list[int] = ()):
        """Fresh heads for a model that start as its LM head would draft (heads_init.py);
        tied, head_input, mlp_size and init_std shape MLP heads, feature_layers a block."""
        init_heads = resolve("vllm_mtpspec.heads_init:init_heads")
        return init_heads(model, model_dir, num_heads=num_heads, tied=tied, head_input=head_input, mlp_size=mlp_size,
                          init_std=init_std, seed=seed, head_kind=self.name)

    def seeded_from(self, heads):
        """Heads of this kind that start from trained heads of another kind, or None where
        this kind cannot start from them."""
        return None

    def drafter(self, heads, model):
        """What the reference decoder drafts with (drafter.py)."""
        return resolve(self.reference_drafter)(heads, model)
