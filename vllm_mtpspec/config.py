"""What the heads are (HeadsConfig) and how to draft with them (SpecOptions).

Both are plain, typed, keyword-only dataclasses. HeadsConfig is written into a heads
directory's config.json; SpecOptions arrive from the user (the CLI, or vLLM's
speculative/additional config) and are validated at start-up so that a typo fails fast.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from vllm_mtpspec.kinds.base import DrafterKind
from vllm_mtpspec.kinds.registry import UnknownKindError, kind_named

FORMAT_VERSION = 1

HEAD_INPUTS = ("hidden", "hidden+token")
# What kinds of drafter there are and what each can do: vllm_mtpspec/kinds/ (one module per
# kind, one table).
TREE_PRESETS = ("chain", "consensus", "static", "dynamic")
DRAFT_SIZES = ("fixed", "planned")
PACE_COHORTS = ("never", "sampled", "always")
# Options that were removed -> what to give instead: refused by name at start-up, not as
# unknown keys, so that a config written for an older release says what to change.
RETIRED_OPTIONS = {
    # The learned draft size: never ahead of the fixed back-off consistently,
    # superseded by the planner.
    "adaptive_draft_size": "it turned on the learned draft size, which the planner superseded: drop it, and "
                           "give draft_size='planned' where it was true",
}
# The dtype the heads draft in: "auto" (the platform's choice, platform_defaults.py),
# "model" (the served model's dtype), a dtype, or "int8" (the heads' matrices and the draft
# vocabulary's rows in INT8 on the CPU, the rest in fp32: quant/int8_dynamic.py). Only the
# drafts depend on it: the target verifies them in its own dtype, so the output does not.
DRAFT_DTYPES = ("auto", "model", "bfloat16", "float16", "float32", "int8")
# Which tokens heads that carry a draft vocabulary (draft_vocab.py) draft among: "auto" (the
# platform's choice, platform_defaults.drafts_whole_vocabulary), "heads" (their draft
# vocabulary) or "full" (the target's whole vocabulary, through its LM head). Only which
# tokens are guessed depends on it: the target verifies every guess.
DRAFT_VOCABS = ("auto", "heads", "full")


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the field and the fix."""


def reject_unknown_keys(cls, raw: dict[str, Any], *, source: str, noun: str = "field",
                        error: type[Exception] = ConfigError, retired: dict[str, str] | None = None) -> None:
    """A typo in a config key fails loudly, listing the keys that would have worked; a key
    of `retired` (key -> what to do instead) is named with its replacement."""
    gone = sorted(set(raw) & set(retired or {}))
    if gone:
        raise error(f"{source}: {noun} {gone[0]!r} was retired; {retired[gone[0]]}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise error(f"{source}: unknown {noun}(s) {unknown}; known {noun}s are {sorted(known)}")


@dataclass(kw_only=True)
class QuantConfig:
    bits: int = 2
    group_size: int = 64
    method: str = "rtn"              # how the codes were chosen: rtn, search, gptq, qat
    calibration: str | None = None   # the data the calibrated methods saw

    def __post_init__(self) -> None:
        from vllm_mtpspec.quant.calibrated import RECORDED_METHODS

        if self.method not in RECORDED_METHODS:
            raise ConfigError(f"quantization.method={self.method!r}: one of {RECORDED_METHODS}")
        if self.bits != 2:
            raise ConfigError(f"quantization.bits={self.bits}: only 2-bit heads are supported")
        if self.group_size <= 0 or self.group_size % 4:
            raise ConfigError(
                f"quantization.group_size={self.group_size}: must be a positive multiple of 4 "
                "(four 2-bit values share a byte); 64 is the default"
            )


def layers_beyond(feature_layers, num_layers: int) -> list[int]:
    """The layer indices among feature_layers that a target with num_layers layers
    (0 .. num_layers - 1) does not have."""
    return [layer for layer in feature_layers if not 0 <= layer < num_layers]


@dataclass(kw_only=True)
class BlockConfig:
    """The shape of an attention draft block: a Llama decoder layer (grouped-query
    attention with RoPE, SwiGLU MLP). Defaults come from the target's own layers."""
    attention_heads: int
    kv_heads: int
    head_dim: int
    mlp_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    # The most cached context entries the block attends to (a sliding window): training
    # saw the last 512 prompt rows plus an answer of up to 256.
    window: int = 1024
    # Target layers whose input states the block reads besides the final one (EAGLE-3's
    # low, middle and high features: what layer l receives, vLLM's aux_hidden_states for
    # l). Empty: the final state only.
    feature_layers: list[int] = field(default_factory=list)
    # EAGLE-3 layers only (eagle3_layer.py): the residual stream starts at the normalized
    # hidden state rather than the raw one (the speculators format's default).
    norm_before_residual: bool = False

    def __post_init__(self) -> None:
        for name in ("attention_heads", "kv_heads", "head_dim", "mlp_size", "window"):
            if getattr(self, name) < 1:
                raise ConfigError(f"block.{name}={getattr(self, name)}: must be >= 1")
        self.feature_layers = [int(layer) for layer in self.feature_layers]
        # Ascending, as vLLM returns aux_hidden_states.
        if any(layer < 0 for layer in self.feature_layers) or self.feature_layers != sorted(set(self.feature_layers)):
            raise ConfigError(f"block.feature_layers={self.feature_layers}: give distinct layer indices >= 0 in "
                              "ascending order")
        if self.attention_heads % self.kv_heads:
            raise ConfigError(f"block.attention_heads={self.attention_heads} is not a multiple of "
                              f"block.kv_heads={self.kv_heads}: each key/value head serves a whole group of queries")
        if self.head_dim % 2:
            raise ConfigError(f"block.head_dim={self.head_dim}: RoPE rotates pairs, so it must be even")


@dataclass(kw_only=True)
class HeadsConfig:
    num_heads: int                        # draft depths (an attention block: depths trained)
    hidden_size: int
    vocab_size: int
    tied: bool = True
    head_kind: str = "parallel"           # a registered drafter kind (kinds/)
    block: BlockConfig | None = None      # an attention draft block's shape (kinds/attention.py)
    # "hidden": head i sees h_t alone (Medusa). "hidden+token": head i also sees the input
    # embedding of x_{t+1}, the token just sampled from h_t (DeepSeek-V3 MTP, FastMTP).
    head_input: str = "hidden"
    # Multiplies the token embedding so that it is on the hidden state's scale.
    embed_scale: float = 1.0
    # Width of each head's hidden layer; 0 = no hidden layer (Medusa's single residual
    # layer). A hidden layer of 2-4 x hidden_size lifted every head's top-1 on SmolLM2
    # (benchmarks/results/head_block_sweep.md); the shipped heads use 4x.
    mlp_size: int = 0
    temperatures: list[float] = field(default_factory=list)
    # Heads that draft among the N most frequent tokens only (draft_vocab.py); the id map
    # is the tensor draft_token_ids in heads.safetensors. 0: the whole vocabulary.
    draft_vocab_size: int = 0
    quantization: QuantConfig | None = None
    base_model_fingerprint: str = ""
    base_model_name: str = ""
    base_model_num_params: int = 0        # for reporting the heads' overhead
    # Measured on held-out data by the training job: rank_accuracy[d][r] is how often the
    # r-th candidate of head d is the target's token. Static and consensus trees use it.
    rank_accuracy: list[list[float]] | None = None
    # A draft block's chains lean toward what the context repeats (copy_bias.py): the logit
    # bias by repeat length, fitted per drafter by vllm_mtpspec_train/fit_copy_bias.py.
    # None: no bias.
    copy_bias: dict[str, float] | None = None
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.num_heads < 1:
            raise ConfigError(f"num_heads={self.num_heads}: need at least one head")
        try:
            kind = kind_named(self.head_kind)
        except UnknownKindError as err:
            raise ConfigError(str(err)) from None
        if isinstance(self.block, dict):
            reject_unknown_keys(BlockConfig, self.block, source="block")
            self.block = BlockConfig(**self.block)
        if self.head_input not in HEAD_INPUTS:
            raise ConfigError(f"head_input={self.head_input!r}: choose one of {HEAD_INPUTS}")
        if self.copy_bias is not None:
            from vllm_mtpspec.copy_bias import check_copy_bias
            try:
                self.copy_bias = check_copy_bias(self.copy_bias)
            except ValueError as err:
                raise ConfigError(f"{err}; refit it with `python -m vllm_mtpspec_train.fit_copy_bias`") from None
        if (refusal := kind.refusal(self)) is not None:
            raise ConfigError(refusal)
        if self.mlp_size < 0:
            raise ConfigError(f"mlp_size={self.mlp_size}: must be >= 0 (0 = no hidden layer)")
        if not self.temperatures:
            self.temperatures = [1.0] * self.num_heads
        if len(self.temperatures) != self.num_heads:
            raise ConfigError(
                f"temperatures has {len(self.temperatures)} entries for {self.num_heads} heads"
            )
        if any(t <= 0 for t in self.temperatures):
            raise ConfigError(f"temperatures={self.temperatures}: each must be > 0")
        if isinstance(self.quantization, dict):
            self.quantization = QuantConfig(**self.quantization)
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ConfigError(f"draft_vocab_size={self.draft_vocab_size}: must lie in 0..vocab_size={self.vocab_size} "
                              "(0: the whole vocabulary)")
        if self.draft_vocab_size and not self.tied and not kind.own_head_vocabulary:
            raise ConfigError(f"draft_vocab_size={self.draft_vocab_size} with tied=false: a draft vocabulary is "
                              "built for tied heads (they slice the target's LM head); set draft_vocab_size=0")

    @property
    def kind(self) -> DrafterKind:
        """What this kind of drafter is and can do (kinds/)."""
        return kind_named(self.head_kind)

    @property
    def feature_layers(self) -> list[int]:
        """Target layers whose input states the drafts read besides the final state (a
        draft block's block.feature_layers; none for MLP heads)."""
        return list(self.block.feature_layers) if self.block is not None else []

    @property
    def token_conditioned(self) -> bool:
        return self.head_input == "hidden+token"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> "HeadsConfig":
        reject_unknown_keys(cls, raw, source=source)
        version = raw.get("format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise ConfigError(
                f"{source}: format_version={version}, this vllm-mtpspec reads {FORMAT_VERSION}; "
                "re-export the heads with a matching version"
            )
        try:
            return cls(**raw)
        except TypeError as err:  # a missing required field
            raise ConfigError(f"{source}: {err}") from None


@dataclass(kw_only=True)
class SpecOptions:
    """How to draft: the user-facing options, shared by the reference decoder and vLLM."""

    heads: str = ""                       # heads directory
    num_speculative_tokens: int | None = None  # heads used (tree depth); None = all heads
    tree: str = "chain"
    max_tree_nodes: int = 16              # node budget for consensus/static/dynamic trees
    dynamic_top_k: int = 4                # candidates per head considered by dynamic trees
    min_path_prob: float = 0.02           # adaptive depth: stop growing below this
    head_rank_accuracy: list[list[float]] | None = None  # static trees: acc[depth][rank]
    # How much to draft per step (draft_size; None: the platform's default, "planned" for
    # chains on CPUs, "fixed" elsewhere and for trees):
    # - "fixed": a back-off, above batch_backoff_start running requests one token fewer
    #   (and half the tree nodes) per doubling (batch_backoff_start None: 4 on CPUs, 16
    #   elsewhere);
    # - "planned": from batch_backoff_start running requests up, per request and step, the
    #   drafts whose expected accepted tokens are worth the verify time they add, by the
    #   step cost measured while serving (draft_planner.py); below it, whole chains as the
    #   fixed rule drafts them; chains only.
    draft_size: str | None = None
    batch_backoff_start: int | None = None
    # "planned" only: in a batch whose requests all started together with one max_tokens
    # and that nobody joins (LLM.generate on a list of prompts), only the requests that have
    # made the fewest tokens draft, so that the batch ends together instead of in a tail of
    # near-empty steps (cohort.py): in batches with a sampled request ("sampled"), in every
    # such batch ("always") or never. None, wherever the planner plans: sampled batches, and
    # greedy ones of cohort.GREEDY_PACED_FROM (16) requests or more (side by side, pacing
    # measured ahead of unpaced on sampled batches and on greedy ones of 16-64, level or
    # behind on greedy ones of 4-8; benchmarks/RESULTS.md).
    pace_cohorts: str | None = None
    # Prompt lookup (lookup.py): where the context's last prompt_lookup_min..max tokens
    # occurred before, draft what followed them instead of the heads' guesses. 0: off.
    # On by default: at batch 1 it took mtpspec from 1.03x to 1.33x-1.54x of vLLM alone,
    # past vLLM's ngram method, in every measured run (benchmarks/RESULTS.md).
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # What the heads (and the draft vocabulary's LM-head rows) compute in (DRAFT_DTYPES).
    # At batch 1 drafting reads every head weight per step: on a CPU with native bf16 an
    # fp32 model's heads drafted 3-4x faster in bf16 (benchmarks/RESULTS.md); "int8" reads
    # a quarter of fp32's bytes, and is `auto`'s choice on CPUs without native bf16.
    draft_dtype: str = "auto"
    # For heads with a draft vocabulary (DRAFT_VOCABS): its few thousand rows make a CPU's
    # draft step several times cheaper, the whole vocabulary keeps more tokens a step.
    draft_vocab: str = "auto"
    # A draft block only: MiB of the entries of requests that left, kept for later requests
    # that begin with the same tokens (vllm/context_store.py), so that a prompt served from
    # vLLM's prefix cache (a chat's earlier turns) drafts from its whole context. They live
    # beside the block, outside vLLM's KV-cache accounting. None: 64; 0: off.
    context_store_mb: int | None = None

    def __post_init__(self) -> None:
        if self.tree not in TREE_PRESETS:
            raise ConfigError(f"tree={self.tree!r}: unknown tree preset; choose one of {TREE_PRESETS}")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ConfigError(f"num_speculative_tokens={self.num_speculative_tokens}: must be >= 1")
        if self.max_tree_nodes < 1:
            raise ConfigError(f"max_tree_nodes={self.max_tree_nodes}: must be >= 1")
        if self.batch_backoff_start is not None and self.batch_backoff_start < 1:
            raise ConfigError(f"batch_backoff_start={self.batch_backoff_start}: must be >= 1")
        if self.draft_size == "learned":
            raise ConfigError("draft_size='learned' was retired (the planner superseded it): give "
                              "draft_size='planned' for chains, or draft_size='fixed' for trees")
        if self.pace_cohorts is not None and self.pace_cohorts not in PACE_COHORTS:
            raise ConfigError(f"pace_cohorts={self.pace_cohorts!r}: choose one of {PACE_COHORTS}")
        if self.pace_cohorts not in (None, "never") and self.draft_size not in (None, "planned"):
            raise ConfigError(f"pace_cohorts={self.pace_cohorts!r} paces the planner's drafts and "
                              f"draft_size={self.draft_size!r} was asked: give draft_size='planned', or "
                              "pace_cohorts='never'")
        if self.draft_size is not None and self.draft_size not in DRAFT_SIZES:
            raise ConfigError(f"draft_size={self.draft_size!r}: choose one of {DRAFT_SIZES}")
        if self.draft_size == "planned" and self.tree != "chain":
            raise ConfigError(f"draft_size='planned' plans chains, and tree={self.tree!r} was asked: use "
                              "tree='chain', or draft_size='fixed' for trees")
        if self.draft_dtype not in DRAFT_DTYPES:
            raise ConfigError(f"draft_dtype={self.draft_dtype!r}: choose one of {DRAFT_DTYPES}")
        if self.draft_vocab not in DRAFT_VOCABS:
            raise ConfigError(f"draft_vocab={self.draft_vocab!r}: choose one of {DRAFT_VOCABS}")
        if self.context_store_mb is not None and (isinstance(self.context_store_mb, bool) or
                                                  not isinstance(self.context_store_mb, int) or
                                                  self.context_store_mb < 0):
            raise ConfigError(f"context_store_mb={self.context_store_mb!r}: give a whole number of MiB, "
                              "or 0 to keep no entries")
        if not 0.0 <= self.min_path_prob < 1.0:
            raise ConfigError(f"min_path_prob={self.min_path_prob}: must lie in [0, 1)")
        if self.prompt_lookup_max < 0 or self.prompt_lookup_max and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(f"prompt_lookup_min={self.prompt_lookup_min}, prompt_lookup_max={self.prompt_lookup_max}: "
                              "need 1 <= prompt_lookup_min <= prompt_lookup_max (or prompt_lookup_max=0 for off)")

    def draft_size_rule(self, platform_default: str) -> str:
        """"fixed" or "planned": what was asked, else the platform's default (which never
        plans trees)."""
        if self.draft_size is not None:
            return self.draft_size
        return "fixed" if platform_default == "planned" and self.tree != "chain" else platform_default

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "options") -> "SpecOptions":
        reject_unknown_keys(cls, raw, source=source, noun="option", retired=RETIRED_OPTIONS)
        return cls(**raw)

    def depth_for(self, heads_config: HeadsConfig, *, source: str = "options") -> int:
        """The number of heads to use, checked against what the heads directory holds."""
        k = self.num_speculative_tokens or heads_config.num_heads
        if k > heads_config.num_heads:
            raise ConfigError(
                f"{source}: num_speculative_tokens={k} but the heads directory has only "
                f"{heads_config.num_heads} heads; lower num_speculative_tokens to at most "
                f"{heads_config.num_heads} or train more heads"
            )
        return k
