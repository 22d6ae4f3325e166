"""EAGLE-3 drafters (kinds/eagle3.py, eagle3_layer.py, eagle3_format.py): published formats
read as vLLM reads them, refused where the plugin would compute something else, and the
plugin's chains equal to vLLM's own EagleProposer's drafts on the same weights."""
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vllm_mtpspec.checkpoint import HeadsError, load_heads, read_heads_config
from vllm_mtpspec.eagle3_format import LAYER_WEIGHTS, write_speculators
from vllm_mtpspec.heads_init import init_eagle3_layer
from vllm_mtpspec.kinds import PARALLEL as PARALLEL_KIND

LAYERS = [1, 2, 3]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A 4-layer random Llama: EAGLE-3 reads three of its layers' input states."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("target")
    model.save_pretrained(folder)
    return model, folder


def draft_vocab_layer(model, folder, size: int = 100):
    """An untied layer drafting among `size` tokens (ids spread over the vocabulary)."""
    layer = init_eagle3_layer(model, folder, num_heads=3, tied=False, feature_layers=LAYERS)
    ids = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(1))[:size].sort().values
    config = layer.config
    config.draft_vocab_size = size
    from vllm_mtpspec.eagle3_layer import Eagle3Layer

    small = Eagle3Layer(config)
    state = {k: v for k, v in layer.state_dict().items() if k != "lm_head.weight"}
    state["lm_head.weight"] = layer.lm_head.weight.detach()[ids]
    state["draft_token_ids"] = ids
    small.load_state_dict(state)
    return small


def write_original(layer, out):
    """The layer in the original EAGLE-3 format (LlamaForCausalLMEagle3, `midlayer.`)."""
    out.mkdir(parents=True, exist_ok=True)
    state, config, block = layer.state_dict(), layer.config, layer.config.block
    tensors = {"midlayer." + key: state[name] for name, key in LAYER_WEIGHTS.items()}
    tensors.update({k: state[k] for k in ("fc.weight", "norm.weight", "lm_head.weight")})
    if config.draft_vocab_size:
        tensors["d2t"] = state["draft_token_ids"] - torch.arange(config.draft_vocab_size)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    raw = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": config.hidden_size,
           "intermediate_size": block.mlp_size, "num_attention_heads": block.attention_heads,
           "num_key_value_heads": block.kv_heads, "num_hidden_layers": 1, "rms_norm_eps": block.rms_norm_eps,
           "rope_theta": block.rope_theta, "vocab_size": config.vocab_size, "hidden_act": "silu",
           "draft_vocab_size": config.draft_vocab_size or config.vocab_size, "max_position_embeddings": 512,
           "norm_before_residual": block.norm_before_residual,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(block.feature_layers)}}
    (out / "config.json").write_text(json.dumps(raw))
    return out


@pytest.mark.parametrize("form", ["speculators", "original"])
def test_both_published_formats_load_as_the_layer_that_wrote_them(target, tmp_path, form):
    model, folder = target
    layer = draft_vocab_layer(model, folder)
    out = write_speculators(layer, tmp_path / form) if form == "speculators" else write_original(layer, tmp_path / form)
    loaded = load_heads(out)
    assert type(loaded) is type(layer) and loaded.config.head_kind == "eagle3" and not loaded.config.tied
    assert loaded.config.block.feature_layers == LAYERS and loaded.config.draft_vocab_size == 100
    for name, tensor in layer.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0, msg=name)


def test_the_layers_read_by_default_come_from_the_served_model(target, tmp_path):
    model, folder = target
    out = write_original(init_eagle3_layer(model, folder, num_heads=3, tied=False, feature_layers=LAYERS),
                         tmp_path / "original")
    raw = json.loads((out / "config.json").read_text())
    del raw["eagle_config"]
    (out / "config.json").write_text(json.dumps(raw))
    with pytest.raises(HeadsError, match=r"eagle_aux_hidden_state_layer_ids: not given.*add the layer ids"):
        read_heads_config(out)
    # vLLM's default for a 30-layer Llama: 2, 15, 27.
    assert read_heads_config(out, target_layers=30).block.feature_layers == [2, 15, 27]


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"rope_scaling: .*plain RoPE"),
    ({"num_hidden_layers": 2}, r"num_hidden_layers: 2: the plugin drafts with one-layer"),
    ({"norm_before_fc": True}, r"norm_before_fc: true: a variant"),
    ({"target_hidden_size": 128}, r"target_hidden_size: 128 differs from hidden_size=64"),
])
def test_what_the_plugin_would_compute_otherwise_is_refused_by_key(target, tmp_path, change, message):
    model, folder = target
    out = write_original(init_eagle3_layer(model, folder, num_heads=3, tied=False, feature_layers=LAYERS),
                         tmp_path / "original")
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(HeadsError, match=rf"{out}/config.json: {message}"):
        read_heads_config(out)


def test_a_missing_or_misshapen_tensor_is_named(target, tmp_path):
    from safetensors.torch import load_file

    model, folder = target
    out = write_speculators(draft_vocab_layer(model, folder), tmp_path / "speculators")
    tensors = load_file(str(out / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "d2t"}, str(out / "model.safetensors"))
    with pytest.raises(HeadsError, match=r"d2t is missing: a drafter with draft_vocab_size=100"):
        load_heads(out)
    save_file({k: v for k, v in tensors.items() if k != "layers.0.self_attn.k_proj.weight"},
              str(out / "model.safetensors"))
    with pytest.raises(HeadsError, match=r"tensor 'layers.0.self_attn.k_proj.weight' is missing"):
        load_heads(out)


def test_the_layers_chains_are_what_its_unrolled_training_form_computes(target):
    """Drafting (the cache, appended and cut per depth) and the unrolled form (every
    position's chain at once, as training runs it) are the same function."""
    model, folder = target
    layer = init_eagle3_layer(model, folder, num_heads=3, tied=False, feature_layers=LAYERS).eval()
    t, d = 12, model.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    features, layer_features = torch.randn(t, d, generator=generator), torch.randn(t, 3, d, generator=generator)
    tokens = torch.randint(0, 256, (t + 3,), generator=generator)
    embed = model.get_input_embeddings()
    with torch.no_grad():
        unrolled = layer.unrolled(features[None], [embed(tokens[j + 1:j + 1 + t])[None] for j in range(3)],
                                  torch.arange(t)[None], torch.ones(1, t, dtype=torch.bool), layer_features[None])
        cache = layer.empty_cache()
        g = layer.extend(cache, features[:8], embed(tokens[1:9]), layer_features[:8])
        # Row 7's chain, fed the right tokens: depth j reads depth j - 1's output and s_{7+j+1}.
        outputs = [g[-1:]]
        for j in range(1, 3):
            x = layer.fused_inputs(outputs[-1], embed(tokens[8 + j:9 + j]))
            outputs.append(layer._extend([cache], x, [1]))
    for j in range(3):
        torch.testing.assert_close(outputs[j][0], unrolled[j][0, 7], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["tiny-random-llama", "smollm2-135m-instruct"])
def test_the_plugins_chains_are_vllms_eagle3_drafts_on_the_same_weights(tmp_path, which):
    """fp32 targets (a 4-layer random Llama, and SmolLM2-135M-Instruct) and a random EAGLE-3
    layer written in the speculators format: vLLM's own `eagle3` and the plugin serving
    that folder verify the same drafts at every step (the plugin's cut at max_tokens aside),
    and both answer as vLLM alone."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from tests.conftest import make_tiny_smol
    from tests.test_vllm_integration import build, chat_prompts, close
    from vllm_mtpspec.models import fetch_model
    from vllm_mtpspec.target import load_target

    if which == "tiny-random-llama":
        # Four layers: EAGLE-3 reads the states entering three of them.
        model_dir, layers = make_tiny_smol(tmp_path / "tiny", seed=0, num_layers=4), [1, 2, 3]
    else:
        model_dir, layers = fetch_model("smollm2-135m-instruct", dtype="fp32"), []  # vLLM's default: 2, 15, 27
    target = load_target(str(model_dir), dtype="fp32")
    layer = init_eagle3_layer(target.model, model_dir, num_heads=3, tied=False, seed=0, feature_layers=layers)
    drafter = write_speculators(layer, tmp_path / "eagle3", verifier=str(model_dir))
    del target, layer

    verified: list[list[int]] = []
    original = GPUModelRunner.execute_model

    def recording(self, scheduler_output, *args, **kwargs):
        # Every step of the one running request, with the drafts it verifies (none: []).
        drafts = scheduler_output.scheduled_spec_decode_tokens or {}
        for req_id in scheduler_output.num_scheduled_tokens:
            verified.append([int(t) for t in drafts.get(req_id, ()) if t >= 0])
        return original(self, scheduler_output, *args, **kwargs)

    def served(**kwargs):
        llm = build(model_dir, **kwargs)
        outputs, steps = [], []
        for prompt in chat_prompts(llm)[:4]:  # one request at a time: its steps are its own
            verified.clear()
            out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
            outputs.append(list(out[0].outputs[0].token_ids))
            steps.append(list(verified))
        close(llm)
        return outputs, steps

    GPUModelRunner.execute_model = recording
    try:
        alone, _ = served()
        vllms, vllm_steps = served(speculative_config={"method": "eagle3", "model": str(drafter),
                                                       "num_speculative_tokens": 3})
        ours, our_steps = served(speculative_config={
            "method": "mtpspec", "model": str(drafter), "num_speculative_tokens": 3, "draft_size": "fixed",
            "batch_backoff_start": 64, "prompt_lookup_max": 0, "min_path_prob": 0.0, "draft_dtype": "float32"})
    finally:
        GPUModelRunner.execute_model = original
    assert vllms == alone and ours == alone
    for prompt, (theirs, mine) in enumerate(zip(vllm_steps, our_steps)):
        assert len(mine) == len(theirs), prompt
        # The plugin sends no draft past max_tokens; vLLM verifies them anyway.
        assert all(m == t[:len(m)] for m, t in zip(mine, theirs)), (prompt, mine, theirs)
        drafted_steps = [m for m in mine if m]
        assert len(drafted_steps) >= len(mine) - 3 and all(len(m) == 3 for m in drafted_steps[:-2]), (prompt, mine)


def test_export_writes_a_tied_layer_with_the_targets_rows_for_stock_vllm(target, tmp_path, capsys):
    from vllm_mtpspec.checkpoint import save_heads
    from vllm_mtpspec.cli import main

    model, folder = target
    tied = init_eagle3_layer(model, folder, num_heads=3, tied=True, feature_layers=LAYERS)
    ours = save_heads(tied, tmp_path / "ours")
    with pytest.raises(SystemExit, match="pass --model"):
        main(["heads", "export-eagle3", str(ours), "--out", str(tmp_path / "no-model")])
    assert main(["heads", "export-eagle3", str(ours), "--out", str(tmp_path / "out"), "--model", str(folder)]) == 0
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3" and raw["eagle_aux_hidden_state_layer_ids"] == LAYERS
    exported = load_heads(tmp_path / "out")
    torch.testing.assert_close(exported.lm_head.weight, model.get_output_embeddings().weight.detach())
    for name, tensor in tied.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    parallel = save_heads(PARALLEL_KIND.initial_heads(model, folder, num_heads=2, seed=0), tmp_path / "parallel")
    assert main(["heads", "export-eagle3", str(parallel), "--out", str(tmp_path / "p")]) != 0
    assert "parallel heads; stock vLLM's eagle3 method serves full-precision EAGLE-3 layers" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_the_bench_runs_vllms_own_eagle3_on_the_plugins_weights(target, tmp_path):
    from vllm_mtpspec.bench.methods import build_methods
    from vllm_mtpspec.checkpoint import save_heads

    model, folder = target
    ours = save_heads(init_eagle3_layer(model, folder, num_heads=3, tied=True, feature_layers=LAYERS), tmp_path / "e3")
    parallel = save_heads(PARALLEL_KIND.initial_heads(model, folder, num_heads=2, seed=0), tmp_path / "parallel")
    methods = build_methods(["eagle3", "mtpspec-chain"], model_dir=str(folder), heads_dirs=[str(ours), str(parallel)],
                            num_heads=[3], quants=["fp"], tree="", work_dir=tmp_path / "work")
    stock = [m for m in methods if m.family == "eagle3"]
    assert [m.unavailable is None for m in stock] == [True, False]
    assert "parallel heads; vLLM's eagle3 method serves" in stock[1].unavailable
    config = stock[0].speculative_config
    assert config["method"] == "eagle3" and config["num_speculative_tokens"] == 3
    exported = load_heads(config["model"])
    torch.testing.assert_close(exported.lm_head.weight, model.get_output_embeddings().weight.detach())
    plugin = [m for m in methods if m.family == "mtpspec-chain"]
    assert plugin[0].speculative_config["model"] == str(ours)
    from vllm_mtpspec.bench.report import heads_memory

    [memory] = heads_memory(config["model"], str(folder), None)  # a published folder's one weights file
    assert memory["heads"] == "EAGLE-3 layer" and memory["bytes"] == (Path(config["model"]) / "model.safetensors").stat().st_size
