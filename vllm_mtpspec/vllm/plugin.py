"""vLLM general plugin: found through the `vllm.general_plugins` entry point and run in
every vLLM process (front end, engine core, workers) before the model runner exists.
Installing the package is all it takes; running twice changes nothing."""
from __future__ import annotations


def register() -> None:
    from vllm_mtpspec.vllm.hooks import install_all

    install_all()
