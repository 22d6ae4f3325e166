"""The dtype the heads draft in: the platform's choice or the user's, applied to the heads
and the draft vocabulary's LM-head rows, never to what the target verifies."""
import copy

import pytest
import torch

from tests.proposers import cpu_proposer
from vllm_mtpspec.checkpoint import save_heads
from vllm_mtpspec.config import ConfigError, SpecOptions
from vllm_mtpspec.heads_init import init_draft_block, init_heads
from vllm_mtpspec.vllm import platform_defaults
from vllm_mtpspec.vllm.platform_defaults import draft_dtype, int8_drafting


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
    # Without native bf16, an fp32 model's full-precision heads draft their matrices in INT8.
    cpu = torch.device("cpu")
    assert int8_drafting("auto", cpu, torch.float32, quantized=False) is not native_bf16
    assert int8_drafting("auto", cpu, torch.bfloat16, quantized=False) is False
    # INT2 heads draft from the values of their codes in INT8 on any CPU (their PyTorch
    # path dequantizes every matrix at every call), never off the CPU.
    assert int8_drafting("auto", cpu, torch.float32, quantized=True) is True
    assert int8_drafting("auto", cpu, torch.bfloat16, quantized=True) is True
    assert int8_drafting("auto", torch.device("cuda"), torch.float32, quantized=True) is False
    assert int8_drafting("auto", torch.device("cuda"), torch.float32, quantized=False) is False


def _loaded_proposer(tiny_model, tiny_model_dir, heads_dir, draft_dtype: str):
    """The proposer of a chain of 3 over the tiny model, heads loaded, drafting in draft_dtype."""
    return cpu_proposer(tiny_model, tiny_model_dir, {"heads": str(heads_dir), "min_path_prob": 0.0,
                                                     "prompt_lookup_max": 0, "draft_dtype": draft_dtype})


@pytest.mark.parametrize("kind", ["parallel", "sequential"])
def test_the_proposer_drafts_in_the_asked_dtype(tiny_model, tiny_model_dir, tmp_path, kind):
    heads = init_heads(tiny_model, tiny_model_dir, num_heads=3, head_input="hidden+token", init_std=0.3, seed=2,
                       head_kind=kind)
    ids = torch.arange(0, 256, 2)
    heads_dir = save_heads(heads.with_draft_vocab(ids), tmp_path / kind)
    p = _loaded_proposer(tiny_model, tiny_model_dir, heads_dir, "bfloat16")
    embed = tiny_model.get_input_embeddings()
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


# ---------------------------------------------------------------------------- INT8 drafting
def _close(int8: torch.Tensor, exact: torch.Tensor, share: float) -> bool:
    """Every entry within `share` of the largest magnitude (INT8's error is relative to that)."""
    return bool(((int8 - exact).abs().max() <= share * exact.abs().max()).item())


def _heads(model, model_dir, kind):
    """Heads of a kind whose every matrix is random (so that each one's INT8 error shows)."""
    if kind != "attention":
        return init_heads(model, model_dir, num_heads=3, head_input="hidden+token", init_std=0.3, seed=2,
                          head_kind=kind)
    block = init_draft_block(model, model_dir, num_heads=3, seed=2)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for linear in (m for m in block.modules() if isinstance(m, torch.nn.Linear)):
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) * linear.in_features ** -0.5)
    return block


@pytest.mark.parametrize("shape", [(1, 576), (8, 576), (2, 3, 64)])
def test_an_int8_linear_multiplies_as_its_weight_does_within_int8s_error(shape):
    from vllm_mtpspec.quant.int8_dynamic import Int8Linear

    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(shape[-1], 300, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(300, shape[-1], generator=gen) * 0.05)
    x = torch.randn(*shape, generator=gen)
    int8 = Int8Linear.from_linear(linear)
    y, exact = int8(x), linear(x).detach()
    assert y.shape == exact.shape and y.dtype == x.dtype
    assert _close(y, exact, 0.03)
    assert not torch.equal(y, exact)  # it really is the INT8 product
    rows = Int8Linear.from_weight(linear.weight)
    assert _close(rows(x), x @ linear.weight.detach().T, 0.03)
    # Nothing of the floating-point weight is held: its shape and dtype answer, its values
    # are the INT8 codes' (within half a step of each row's scale).
    for made in (int8, rows):
        assert made.weight.is_meta and made.weight.shape == linear.weight.shape
        assert made.weight.dtype == linear.weight.dtype
        assert not any(t.numel() and not t.is_meta for name, t in made.named_parameters() if name != "bias")
        step = linear.weight.detach().abs().amax(1, keepdim=True) / 127
        assert ((made.dense_weight() - linear.weight.detach()).abs() <= step / 2 + 1e-7).all()


@pytest.mark.parametrize("kind", ["parallel", "sequential", "attention"])
def test_int8_heads_draft_what_their_fp32_form_drafts_where_the_choice_is_clear(tiny_model, tiny_model_dir, kind):
    from vllm_mtpspec.quant.int8_dynamic import Int8Linear, int8_linears

    heads = _heads(tiny_model, tiny_model_dir, kind).eval()
    int8 = copy.deepcopy(heads)
    linears = [m for m in int8.modules() if type(m) is torch.nn.Linear]
    assert int8_linears(int8) == len(linears) > 0
    assert not any(type(m) is torch.nn.Linear for m in int8.modules())
    assert sum(isinstance(m, Int8Linear) for m in int8.modules()) == len(linears)
    embed = tiny_model.get_input_embeddings()
    weight = tiny_model.get_output_embeddings().weight.detach()
    gen = torch.Generator().manual_seed(1)
    hidden, tokens = torch.randn(16, 64, generator=gen), torch.randint(0, 256, (16,), generator=gen)
    with torch.no_grad():
        if kind == "attention":
            def draft(module):
                caches = [module.empty_cache() for _ in range(16)]
                newest = torch.cat(module.extend_many(caches, list(hidden[:, None]), list(embed(tokens)[:, None])))
                return module.draft_chains(caches, newest, 3, lambda x: x @ weight.T, embed)
        else:
            def draft(module):
                return module.draft_logits(hidden, embed(tokens), 3, lambda x: x @ weight.T, embed)
        exact, approximate = draft(heads), draft(int8)
    # The block's depths feed one another's outputs through whole layers: errors compound.
    assert _close(approximate, exact, 0.12 if kind == "attention" else 0.05)
    # Where fp32's top-1 leads its runner-up clearly, INT8 drafts the same token.
    top2 = exact.topk(2, -1).values
    clear = (top2[..., 0] - top2[..., 1]) > 0.1 * exact.abs().amax(-1)
    assert clear.sum() >= 8
    assert torch.equal(approximate.argmax(-1)[clear], exact.argmax(-1)[clear])


def test_int8_drafting_is_refused_off_the_cpu_naming_the_field():
    fp32 = torch.float32
    assert int8_drafting("int8", torch.device("cpu"), fp32, quantized=False) is True
    assert int8_drafting("int8", torch.device("cpu"), fp32, quantized=True) is True
    for quantized in (False, True):
        with pytest.raises(ConfigError, match="draft_dtype='int8': .*CPU only.*cuda.*use draft_dtype='auto'"):
            int8_drafting("int8", torch.device("cuda"), fp32, quantized=quantized)


@pytest.mark.parametrize("kind", ["parallel", "attention"])
def test_the_proposer_drafts_with_int8_matrices_when_asked(tiny_model, tiny_model_dir, tmp_path, kind):
    from vllm_mtpspec.quant.int8_dynamic import Int8Linear

    heads = _heads(tiny_model, tiny_model_dir, kind)
    heads_dir = save_heads(heads.with_draft_vocab(torch.arange(0, 256, 2)), tmp_path / kind)
    p = _loaded_proposer(tiny_model, tiny_model_dir, heads_dir, "int8")
    assert p.int8_drafts and p.draft_dtype == torch.float32
    assert isinstance(p._lm_head, Int8Linear)
    assert not any(type(m) is torch.nn.Linear for m in p.heads.modules())
    # The INT8 copies are all that is held of the matrices and the LM head's rows, the
    # block's drafting form (its side-by-side products) included.
    int8 = [m for m in p.heads.modules() if isinstance(m, Int8Linear)] + [p._lm_head]
    if kind == "attention":
        form = p.heads._drafting
        int8 += [form.qkv, form.gate_up, form.feature_fuse]
    assert all(isinstance(m, Int8Linear) and m.weight.is_meta for m in int8)


def test_an_int8_copy_of_an_int2_matrix_multiplies_as_its_codes_do():
    from vllm_mtpspec.quant import Int2Linear
    from vllm_mtpspec.quant.int8_dynamic import Int8Linear

    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(576, 300, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(300, 576, generator=gen) * 0.05)
        linear.bias.copy_(torch.randn(300, generator=gen))
    int2 = Int2Linear.from_linear(linear, group_size=64)
    int8 = Int8Linear.from_int2(int2)
    x = torch.randn(4, 576, generator=gen)
    y, exact = int8(x), int2(x)
    assert _close(y - int2.bias, exact - int2.bias, 0.03)
    assert not torch.equal(y, exact)  # the INT8 product of the codes' values
    assert torch.equal(int8.bias, int2.bias)


@pytest.mark.parametrize("kind", ["parallel", "attention"])
def test_int2_heads_draft_through_int8_matrices_on_the_cpu(tiny_model, tiny_model_dir, tmp_path, kind):
    from vllm_mtpspec.quant import Int2Linear
    from vllm_mtpspec.quant.int8_dynamic import Int8Linear

    int2 = _heads(tiny_model, tiny_model_dir, kind).quantized(group_size=32)
    matrices = sum(isinstance(m, Int2Linear) for m in int2.modules())
    heads_dir = save_heads(int2.with_draft_vocab(torch.arange(0, 256, 2)), tmp_path / kind)
    p = _loaded_proposer(tiny_model, tiny_model_dir, heads_dir, "auto")
    assert p.int8_drafts and p.heads.is_quantized
    assert sum(isinstance(m, Int8Linear) for m in p.heads.modules()) == matrices > 0
    assert not any(isinstance(m, Int2Linear) or type(m) is torch.nn.Linear for m in p.heads.modules())
    if kind == "parallel":  # (a block drafts inside vLLM only: tests/test_vllm_integration.py)
        p.capture_step(torch.randn(2, 64), None, ["a", "b"])
        drafts = p.propose([[1], [2]])
        assert len(drafts) == 2 and all(len(d) == 3 for d in drafts)
