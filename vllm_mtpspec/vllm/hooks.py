"""Every patch of a private vLLM method, in one file, each gated by the vLLM version.

1. EngineArgs.create_speculative_config sees the user's speculative dict before vLLM
   validates it (both `vllm serve` and `LLM(...)` go through it): `method="mtpspec"`
   becomes vLLM's own `custom_class` form, and the heads are checked against the served
   model right there, in the front-end process, before any engine starts.
2. GPUModelRunner.propose_draft_token_ids (inherited by CPUModelRunner, same signature in
   0.32 and 0.33) holds the hidden states that a `custom_class` proposer never receives:
   the wrapper hands them to our proposer, then calls vLLM's own method.
"""
from __future__ import annotations

import functools
import inspect
import logging

logger = logging.getLogger("vllm_mtpspec")

_installed: set[str] = set()


def install_speculative_config_hook() -> None:
    if "speculative_config" in _installed:
        return
    from vllm.engine.arg_utils import EngineArgs

    from vllm_mtpspec.vllm.options import METHOD

    original = EngineArgs.create_speculative_config

    @functools.wraps(original)
    def create_speculative_config(self, target_model_config, target_parallel_config):
        spec = self.speculative_config
        if isinstance(spec, dict) and spec.get("method") == METHOD:
            self.speculative_config, self.additional_config = _mtpspec_to_custom_class(
                spec, self.additional_config, target_model_config
            )
        return original(self, target_model_config, target_parallel_config)

    EngineArgs.create_speculative_config = create_speculative_config
    _installed.add("speculative_config")


def _mtpspec_to_custom_class(spec, additional_config, target_model_config):
    from vllm_mtpspec.vllm.options import check_against_model, translate
    from vllm_mtpspec.vllm.version import require_supported_vllm
    from vllm_mtpspec.config import SpecOptions

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
    )
    if vllm_spec.get("num_speculative_tokens") is None:  # default: every head
        vllm_spec["num_speculative_tokens"] = heads_config.num_heads
        merged["mtpspec"]["num_speculative_tokens"] = heads_config.num_heads
    logger.info("mtpspec: %d heads from %s, %d speculative tokens, %s drafts",
                heads_config.num_heads, options.heads, vllm_spec["num_speculative_tokens"], options.tree)
    return vllm_spec, merged


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
        drafter = getattr(self, "drafter", None)
        capture = getattr(drafter, "capture_step", None)
        if capture is not None:
            bound = signature.bind(self, *args, **kwargs)
            capture(
                bound.arguments["sample_hidden_states"],
                bound.arguments["spec_decode_metadata"],
                list(self.input_batch.req_ids),
            )
        return original(self, *args, **kwargs)

    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    _installed.add("hidden_states")


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
