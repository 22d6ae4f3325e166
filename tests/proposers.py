"""The mtpspec proposer as vLLM builds it, over the tiny model on the CPU, for the tests that
drive it directly: one place for the config they share."""
from types import SimpleNamespace

import torch


def cpu_proposer(tiny_model, tiny_model_dir, options: dict, *, max_drafts: int = 3):
    """The proposer for `additional_config={"mtpspec": options}`, its heads loaded.

    It drafts in the model's fp32 unless the options ask otherwise, so that its drafts equal the
    heads' own on every CPU (`auto` drafts in bf16 or INT8 on some)."""
    from vllm_mtpspec.vllm.proposer import MTPSpecProposer

    config = SimpleNamespace(
        additional_config={"mtpspec": {"draft_dtype": "model", **options}},
        model_config=SimpleNamespace(model=str(tiny_model_dir), hf_text_config=tiny_model.config, dtype=torch.float32),
        speculative_config=SimpleNamespace(num_speculative_tokens=max_drafts),
        device_config=SimpleNamespace(device="cpu"),
    )
    proposer = MTPSpecProposer(config)
    proposer.load_model(SimpleNamespace(compute_logits=tiny_model.get_output_embeddings(),
                                        embed_input_ids=tiny_model.get_input_embeddings()))
    return proposer
