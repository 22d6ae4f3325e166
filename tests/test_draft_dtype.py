"""The dtype the heads draft in: the platform's choice or the user's, applied to the heads
and the draft vocabulary's LM-head rows, never to what the target verifies."""
from types import SimpleNamespace

import pytest
import torch

from vllm_mtpspec.checkpoint import save_heads
from vllm_mtpspec.config import ConfigError, SpecOptions
from vllm_mtpspec.heads_init import init_heads
from vllm_mtpspec.vllm import platform_defaults
from vllm_mtpspec.vllm.platform_defaults import draft_dtype


def test_a_draft_dtype_outside_the_choices_is_refused_naming_them():
    with pytest.raises(ConfigError, match="draft_dtype='bf16': choose one of .*'bfloat16'"):
        SpecOptions(draft_dtype="bf16")


@pytest.mark.parametrize("native_bf16", [True, False])
def test_auto_drafts_an_fp32_models_heads_in_bf16_only_where_the_cpu_has_it(monkeypatch, native_bf16):
    monkeypatch.setattr(platform_defaults, "cpu_has_native_bf16", lambda: native_bf16)
    expected = torch.bfloat16 if native_bf16 else torch.float32
    assert draft_dtype("auto", torch.float32, quantized=False) == expected
    assert draft_dtype("auto", torch.float32, quantized=True) == torch.float32   # INT2 heads keep the model's
    assert draft_dtype("auto", torch.bfloat16, quantized=False) == torch.bfloat16
    assert draft_dtype("model", torch.float32, quantized=False) == torch.float32
    assert draft_dtype("float16", torch.float32, quantized=False) == torch.float16  # asked: taken as it is


@pytest.mark.parametrize("kind", ["parallel", "sequential"])
def test_the_proposer_drafts_in_the_asked_dtype(tiny_model, tiny_model_dir, tmp_path, kind):
    from vllm_mtpspec.vllm.proposer import MTPSpecProposer

    heads = init_heads(tiny_model, tiny_model_dir, num_heads=3, head_input="hidden+token", init_std=0.3, seed=2,
                       head_kind=kind)
    ids = torch.arange(0, 256, 2)
    heads_dir = save_heads(heads.with_draft_vocab(ids), tmp_path / kind)
    config = SimpleNamespace(
        additional_config={"mtpspec": {"heads": str(heads_dir), "min_path_prob": 0.0, "prompt_lookup_max": 0,
                                       "draft_dtype": "bfloat16"}},
        model_config=SimpleNamespace(model=str(tiny_model_dir), hf_text_config=tiny_model.config, dtype=torch.float32),
        speculative_config=SimpleNamespace(num_speculative_tokens=3),
        device_config=SimpleNamespace(device="cpu"),
    )
    p = MTPSpecProposer(config)
    embed = tiny_model.get_input_embeddings()
    p.load_model(SimpleNamespace(compute_logits=tiny_model.get_output_embeddings(), embed_input_ids=embed))
    assert p.draft_dtype == torch.bfloat16
    assert all(t.dtype == torch.bfloat16 for name, t in p.heads.state_dict().items() if name != "draft_token_ids")
    hidden = torch.randn(2, 64)
    p.capture_step(hidden, None, ["a", "b"])
    drafts = p.propose([[1], [2]])
    bf16 = heads.with_draft_vocab(ids).to(torch.bfloat16)
    weight = tiny_model.get_output_embeddings().weight.detach().to(torch.bfloat16)
    with torch.no_grad():
        logits = bf16.draft_logits(hidden, embed(torch.tensor([1, 2])), 3, bf16.lm_head_for(weight), embed, ids)
    assert drafts == ids[logits.argmax(-1)].tolist()
