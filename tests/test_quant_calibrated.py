"""Calibrated INT2 quantizers: same packed format as round-to-nearest, less output error."""
import torch

from vllm_mtpspec.quant import Int2Linear, dequantize_int2, quantize_int2
from vllm_mtpspec.quant.calibrated import InputStatistics, gptq_int2, refit_ranges, search_int2


def correlated_inputs(n, dim, seed=0):
    """Inputs whose features are correlated and unevenly scaled, as a layer's inputs are:
    one distribution per dim, samples by seed."""
    layout = torch.Generator().manual_seed(dim)
    mix = torch.randn(dim, dim, generator=layout) / dim ** 0.5
    scale = torch.logspace(-1, 1, dim)[torch.randperm(dim, generator=layout)]
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, dim, generator=gen) @ mix + 0.3 * torch.randn(n, dim, generator=gen)) * scale


def output_error(weight, qw, x):
    return ((x @ weight.T - x @ dequantize_int2(qw).T) ** 2).mean().item()


def test_told_to_do_nothing_they_are_round_to_nearest_byte_for_byte():
    weight = torch.randn(48, 128, generator=torch.Generator().manual_seed(1))
    rtn = quantize_int2(weight, group_size=64)
    for qw in (search_int2(weight, None, group_size=64, grid=(0.0,)),
               gptq_int2(weight, torch.eye(128), group_size=64, damping=0.0, grid=(0.0,))):
        assert torch.equal(qw.packed, rtn.packed)
        assert torch.equal(qw.scales, rtn.scales) and torch.equal(qw.mins, rtn.mins)


def test_unaligned_inputs_dequantize_like_round_to_nearest():
    weight = torch.randn(8, 100, generator=torch.Generator().manual_seed(2))
    rtn = quantize_int2(weight, group_size=64)
    qw = gptq_int2(weight, torch.eye(100), group_size=64, damping=0.0, grid=(0.0,))
    assert torch.equal(dequantize_int2(qw), dequantize_int2(rtn))


def correlated_layer():
    """A random layer with its calibration inputs (and their statistics) and held-out inputs."""
    torch.manual_seed(0)
    weight = torch.randn(64, 256) * 0.05
    calibration, held_out = correlated_inputs(4096, 256, seed=1), correlated_inputs(2048, 256, seed=2)
    stats = InputStatistics(256)
    stats.add(calibration)
    return weight, calibration, held_out, stats


def test_search_and_gptq_cut_the_output_error_on_correlated_inputs():
    weight, calibration, held_out, stats = correlated_layer()
    rtn = output_error(weight, quantize_int2(weight, group_size=64), held_out)
    search = output_error(weight, search_int2(weight, stats.hessian, group_size=64), held_out)
    gptq = output_error(weight, gptq_int2(weight, stats.hessian, group_size=64), held_out)
    assert search < 0.9 * rtn, (search, rtn)
    assert gptq < 0.7 * rtn and gptq < search, (gptq, search, rtn)


def test_refitted_ranges_keep_the_codes_and_cut_gptqs_output_error():
    weight, calibration, held_out, stats = correlated_layer()
    gptq = gptq_int2(weight, stats.hessian, group_size=64)
    refit = refit_ranges(weight, stats.hessian, gptq)
    assert torch.equal(refit.packed, gptq.packed) and refit.scales.dtype == torch.float16
    assert not torch.equal(refit.scales, gptq.scales)
    # On the calibration inputs no row errs more (the fit is least squares there, and a
    # row whose rounded fit would err more keeps its ranges); on held-out inputs it errs less.
    def row_errors(qw, x):
        return ((x @ weight.T - x @ dequantize_int2(qw).T) ** 2).mean(0)
    assert (row_errors(refit, calibration) <= row_errors(gptq, calibration) * (1 + 1e-6)).all()
    assert output_error(weight, refit, held_out) < 0.97 * output_error(weight, gptq, held_out)


def test_refitting_exact_ranges_changes_nothing():
    # Weights that are exactly codes under fp16 ranges: those ranges are already the fit.
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 4, (16, 128), generator=gen).float()
    scales = (torch.rand(16, 2, 1, generator=gen) + 0.5).half().float()
    mins = (torch.randn(16, 2, 1, generator=gen)).half().float()
    weight = (codes.view(16, 2, 64) * scales + mins).view(16, 128)
    rtn = quantize_int2(weight, group_size=64)
    stats = InputStatistics(128)
    stats.add(correlated_inputs(1024, 128))
    refit = refit_ranges(weight, stats.hessian, rtn)
    torch.testing.assert_close(dequantize_int2(refit), weight, atol=2e-3, rtol=0)


def test_the_packed_weights_load_and_run_as_any_int2_linear():
    weight = torch.randn(32, 128)
    x = correlated_inputs(256, 128)
    stats = InputStatistics(128)
    stats.add(x)
    qw = gptq_int2(weight, stats.hessian, group_size=32)
    layer = Int2Linear(qw)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    assert set(state) == set(Int2Linear(quantize_int2(weight, group_size=32)).state_dict())
    assert state["packed"].dtype == torch.uint8 and state["scales"].dtype == torch.float16
    torch.testing.assert_close(layer(x), x @ dequantize_int2(qw).T)


def make_heads(tiny_model, tiny_model_dir, **kwargs):
    from vllm_mtpspec.heads_init import init_heads

    return init_heads(tiny_model, tiny_model_dir, num_heads=2, init_std=0.05, seed=0, **kwargs).float()


def calibration_batches(heads, tiny_model, n=512):
    embed = tiny_model.get_input_embeddings().weight.detach()
    gen = torch.Generator().manual_seed(5)
    hidden = correlated_inputs(n, heads.config.hidden_size, seed=3)
    tokens = torch.randint(0, embed.shape[0], (n,), generator=gen)
    return [(hidden[i:i + 128], embed[tokens[i:i + 128]]) for i in range(0, n, 128)]


def test_heads_quantized_by_each_method_load_and_record_how(tiny_model, tiny_model_dir, tmp_path):
    from vllm_mtpspec.checkpoint import load_heads, save_heads
    from vllm_mtpspec.heads_quant import input_statistics, quantize_heads

    heads = make_heads(tiny_model, tiny_model_dir, head_input="hidden+token", mlp_size=64, tied=False)
    lm_head = tiny_model.get_output_embeddings()
    stats = input_statistics(heads, calibration_batches(heads, tiny_model), lm_head=lm_head)
    assert set(stats) == {"block", "down.0", "down.1", "proj.0", "proj.1"}
    assert stats["block"].count == 512 and stats["block"].sum.shape == (2 * heads.config.hidden_size,) * 2
    rtn = quantize_heads(heads, method="rtn")
    assert all(torch.equal(a, b) for a, b in zip(rtn.state_dict().values(), heads.quantized().state_dict().values()))
    gptq = quantize_heads(heads, method="gptq", statistics=stats, calibration="512 random rows")
    path = save_heads(gptq, tmp_path / "gptq")
    loaded = load_heads(path)
    assert loaded.config.quantization.method == "gptq"
    assert loaded.config.quantization.calibration == "512 random rows"
    h, e = calibration_batches(heads, tiny_model)[0]
    torch.testing.assert_close(loaded(h, token_embeds=e, lm_head=lm_head), gptq(h, token_embeds=e, lm_head=lm_head))
    # Calibrated, the heads' own output moves less from full precision than rounded.
    want = heads.hidden(h, e)
    assert (gptq.hidden(h, e) - want).pow(2).mean() < (rtn.hidden(h, e) - want).pow(2).mean()


def test_a_calibrated_method_without_calibration_is_refused(tiny_model, tiny_model_dir):
    import pytest

    from vllm_mtpspec.heads_quant import quantize_heads

    with pytest.raises(ValueError, match="needs calibration inputs"):
        quantize_heads(make_heads(tiny_model, tiny_model_dir), method="gptq")
    with pytest.raises(ValueError, match="one of"):
        quantize_heads(make_heads(tiny_model, tiny_model_dir), method="awq")


def test_the_shipped_int2_heads_are_the_shipped_heads_by_gptq_refit(tmp_path):
    from vllm_mtpspec.checkpoint import load_heads
    from vllm_mtpspec.shipped import shipped_heads_dir, shipped_int2_heads_dir

    fp_dir = shipped_heads_dir()
    int2_dir = shipped_int2_heads_dir(fp_dir)
    assert int2_dir is not None and int2_dir.name == "smollm2-135m-instruct-int2"
    assert shipped_int2_heads_dir(tmp_path) is None  # other heads have no shipped INT2 form
    fp, int2 = load_heads(fp_dir), load_heads(int2_dir)
    assert int2.is_quantized and int2.config.quantization.method == "gptq-refit"
    assert int2.config.base_model_fingerprint == fp.config.base_model_fingerprint
    assert (int2.config.head_kind, int2.config.num_heads, int2.config.block, int2.config.head_input) == \
        (fp.config.head_kind, fp.config.num_heads, fp.config.block, fp.config.head_input)
    # It drafts among the same tokens as the full-precision form.
    assert torch.equal(int2.draft_vocab, fp.draft_vocab)
