import json

import pytest
import torch

from vllm_mtpspec.checkpoint import (
    HeadsError,
    check_heads_match_model,
    load_heads,
    model_fingerprint,
    read_heads_config,
    save_heads,
)
from vllm_mtpspec.config import ConfigError, HeadsConfig, SpecOptions
from vllm_mtpspec.heads import MTPHeads
from vllm_mtpspec.heads_init import init_heads


@pytest.fixture
def heads_dir(tmp_path, tiny_model, tiny_model_dir):
    heads = init_heads(tiny_model, tiny_model_dir, num_heads=3, init_std=0.05)
    return save_heads(heads, tmp_path / "heads")


def test_save_and_load_round_trip(heads_dir, tiny_model, tiny_model_dir):
    loaded = load_heads(heads_dir)
    original = init_heads(tiny_model, tiny_model_dir, num_heads=3, init_std=0.05)
    for name, tensor in original.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)
    assert loaded.config.base_model_fingerprint == model_fingerprint(tiny_model_dir)


def test_heads_with_a_hidden_layer_round_trip_in_full_and_int2(tmp_path, tiny_model, tiny_model_dir):
    heads = init_heads(tiny_model, tiny_model_dir, num_heads=3, head_input="hidden+token", mlp_size=96,
                       init_std=0.05, seed=7)
    again = init_heads(tiny_model, tiny_model_dir, num_heads=3, head_input="hidden+token", mlp_size=96,
                       init_std=0.05, seed=7)
    torch.testing.assert_close(again.block.weight, heads.block.weight)  # the seed fixes the random layer
    h, e = torch.randn(5, 64), torch.randn(5, 64)
    lm_head = tiny_model.get_output_embeddings()
    for saved in (heads, heads.quantized(group_size=32)):
        loaded = load_heads(save_heads(saved, tmp_path / f"heads-{saved.is_quantized}"))
        assert loaded.config.mlp_size == 96 and len(loaded.down) == 3
        torch.testing.assert_close(loaded(h, token_embeds=e, lm_head=lm_head), saved(h, token_embeds=e, lm_head=lm_head))


def test_a_hidden_layer_the_weights_lack_is_named(heads_dir):
    raw = json.loads((heads_dir / "config.json").read_text())
    raw["mlp_size"] = 32
    (heads_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(HeadsError, match=r"missing tensors \['down.0.weight'.*mlp_size"):
        load_heads(heads_dir)
    raw["mlp_size"] = -1
    (heads_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(HeadsError, match="mlp_size=-1"):
        load_heads(heads_dir)


def test_quantized_directory_loads_packed(heads_dir, tmp_path):
    qdir = save_heads(load_heads(heads_dir).quantized(group_size=32), tmp_path / "q")
    qheads = load_heads(qdir)
    assert qheads.is_quantized
    assert qheads.block.packed.dtype == torch.uint8
    assert not any(t.dtype == torch.float32 and t.dim() == 2 for t in qheads.state_dict().values())


def test_missing_directory_and_files(tmp_path, heads_dir):
    with pytest.raises(HeadsError, match="does not exist"):
        load_heads(tmp_path / "nowhere")
    (heads_dir / "heads.safetensors").unlink()
    with pytest.raises(HeadsError, match="heads.safetensors is missing"):
        load_heads(heads_dir)


def test_corrupt_config_names_the_file(heads_dir):
    (heads_dir / "config.json").write_text("{not json")
    with pytest.raises(HeadsError, match=r"config.json is not valid JSON"):
        load_heads(heads_dir)


def test_unknown_config_field_is_named(heads_dir):
    raw = json.loads((heads_dir / "config.json").read_text())
    raw["num_headz"] = 3
    (heads_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(HeadsError, match="num_headz"):
        read_heads_config(heads_dir)


@pytest.mark.parametrize("keep_fraction", [0.0, 0.01, 0.5, 0.99])
def test_truncated_weights_file_is_a_clear_error(heads_dir, keep_fraction):
    weights = heads_dir / "heads.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: int(len(data) * keep_fraction)])
    with pytest.raises(HeadsError, match="corrupt or truncated"):
        load_heads(heads_dir)


def test_weights_that_disagree_with_config(heads_dir):
    raw = json.loads((heads_dir / "config.json").read_text())
    raw["num_heads"] = 4
    raw["temperatures"] = [1.0] * 4
    (heads_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(HeadsError, match="needs"):
        load_heads(heads_dir)


def test_heads_for_another_model_are_refused(heads_dir, tiny_model_dir, tmp_path):
    config = read_heads_config(heads_dir)
    with pytest.raises(HeadsError, match="hidden_size=64 but the model's hidden size is 576"):
        check_heads_match_model(config, heads_dir=heads_dir, hidden_size=576, vocab_size=256, fingerprint=None)
    with pytest.raises(HeadsError, match="vocab_size"):
        check_heads_match_model(config, heads_dir=heads_dir, hidden_size=64, vocab_size=49152, fingerprint=None)
    with pytest.raises(HeadsError, match="another model of the same shape"):
        check_heads_match_model(config, heads_dir=heads_dir, hidden_size=64, vocab_size=256, fingerprint="0" * 16)
    check_heads_match_model(config, heads_dir=heads_dir, hidden_size=64, vocab_size=256,
                            fingerprint=model_fingerprint(tiny_model_dir))


def test_fingerprint_tells_models_apart_and_ignores_dtype(tiny_model, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    bf16_dir = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(bf16_dir)
    assert model_fingerprint(bf16_dir) == model_fingerprint(tiny_model_dir)
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        other.get_input_embeddings().weight.add_(0.5)
    other.save_pretrained(tmp_path / "other")
    assert model_fingerprint(tmp_path / "other") != model_fingerprint(tiny_model_dir)


def test_more_speculative_tokens_than_heads_is_refused():
    config = HeadsConfig(num_heads=2, hidden_size=8, vocab_size=10)
    with pytest.raises(ConfigError, match="num_speculative_tokens=3 but the heads directory has only 2 heads"):
        SpecOptions(num_speculative_tokens=3).depth_for(config)
    assert SpecOptions().depth_for(config) == 2


def test_unknown_options_and_presets_are_named():
    with pytest.raises(ConfigError, match="unknown tree preset"):
        SpecOptions(tree="bushy")
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['max_nodes'\]"):
        SpecOptions.from_dict({"max_nodes": 3})


def test_draft_size_rules_and_their_conflicts_are_named():
    assert SpecOptions().draft_size_rule("fixed") == "fixed"
    assert SpecOptions(draft_size="planned").draft_size_rule("fixed") == "planned"
    assert SpecOptions(draft_size="fixed").draft_size_rule("planned") == "fixed"
    # A platform that plans by default still gives trees a rule that can size them.
    assert SpecOptions(tree="consensus").draft_size_rule("planned") == "fixed"
    with pytest.raises(ConfigError, match=r"draft_size='guess': choose one of \('fixed', 'planned'\)"):
        SpecOptions(draft_size="guess")
    with pytest.raises(ConfigError, match="draft_size='planned' plans chains, and tree='dynamic' was asked: use "
                                          "tree='chain', or draft_size='fixed' for trees"):
        SpecOptions(draft_size="planned", tree="dynamic")


@pytest.mark.parametrize("raw", [{"draft_size": "learned"}, {"draft_size": "learned", "tree": "consensus"},
                                 {"draft_size": "learned", "pace_cohorts": "always"}])
def test_the_retired_learned_draft_size_is_refused_with_its_replacements(raw):
    with pytest.raises(ConfigError, match="draft_size='learned' was retired .*: give draft_size='planned' for "
                                          "chains, or draft_size='fixed' for trees"):
        SpecOptions.from_dict(raw, source="additional_config['mtpspec']")


@pytest.mark.parametrize("value", [True, False])
def test_the_retired_adaptive_draft_size_is_refused_by_name_whatever_its_value(value):
    with pytest.raises(ConfigError, match=r"^additional_config\['mtpspec'\]: option 'adaptive_draft_size' was "
                                          r"retired; .*drop it, and give draft_size='planned' where it was true$"):
        SpecOptions.from_dict({"adaptive_draft_size": value, "draft_size": "fixed"},
                              source="additional_config['mtpspec']")


def test_vllms_speculative_config_passes_a_retired_option_on_to_be_named():
    from vllm_mtpspec.vllm.options import translate

    for spec, named in [({"adaptive_draft_size": True}, "option 'adaptive_draft_size' was retired"),
                        ({"draft_size": "learned"}, "draft_size='learned' was retired")]:
        with pytest.raises(ConfigError, match=named):
            translate({"method": "mtpspec", "model": "heads", **spec}, None)
        with pytest.raises(ConfigError, match=named):
            translate({"method": "mtpspec", "model": "heads"}, {"mtpspec": spec})


def test_a_directory_written_before_head_kinds_and_draft_vocabularies_loads_as_it_did(heads_dir, tiny_model):
    """config.json files from before `head_kind`, `block` and `draft_vocab_size` existed
    (heads v5 and earlier) still load as the parallel heads over the whole vocabulary."""
    before = load_heads(heads_dir)
    config_path = heads_dir / "config.json"
    config = json.loads(config_path.read_text())
    old = {k: v for k, v in config.items() if k not in ("head_kind", "block", "draft_vocab_size")}
    assert old != config
    config_path.write_text(json.dumps(old))
    loaded = load_heads(heads_dir)
    assert type(loaded) is MTPHeads and loaded.config.head_kind == "parallel"
    assert loaded.config.draft_vocab_size == 0 and loaded.draft_vocab is None
    h = torch.randn(3, 64)
    lm_head = tiny_model.get_output_embeddings()
    torch.testing.assert_close(loaded(h, lm_head=lm_head), before(h, lm_head=lm_head))
