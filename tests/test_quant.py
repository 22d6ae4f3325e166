import pytest
import torch

from tests.interpreter import run_under_triton_interpreter
from vllm_mtpspec.quant import (
    Int2Linear,
    QuantError,
    dequantize_int2,
    int2_matmul_reference,
    quantize_int2,
)
from vllm_mtpspec.quant.int2 import Int2Weight, pack_codes, unpack_codes


def test_pack_unpack_round_trip():
    codes = torch.randint(0, 4, (5, 64), dtype=torch.uint8)
    packed = pack_codes(codes)
    assert packed.shape == (5, 16)
    torch.testing.assert_close(unpack_codes(packed), codes)


def test_representable_values_round_trip_exactly():
    # Each group holds only min + q * scale with fp16-exact min and scale.
    out_features, in_features, group = 6, 128, 32
    mins = torch.tensor([-1.5, -0.25, 0.0, 2.0])[torch.randint(0, 4, (out_features, in_features // group))]
    scales = torch.tensor([0.5, 0.125, 1.0, 0.25])[torch.randint(0, 4, (out_features, in_features // group))]
    codes = torch.randint(0, 4, (out_features, in_features // group, group)).float()
    codes[..., 0], codes[..., 1] = 0, 3  # each group spans its full range
    weight = (mins.unsqueeze(-1) + codes * scales.unsqueeze(-1)).view(out_features, in_features)
    qw = quantize_int2(weight, group_size=group)
    assert torch.equal(dequantize_int2(qw), weight)


@pytest.mark.parametrize("shape,group", [((64, 256), 64), ((33, 100), 64), ((7, 12), 4), ((1, 576), 128)])
def test_error_bounded_by_half_a_step(shape, group):
    torch.manual_seed(0)
    weight = torch.randn(shape)
    qw = quantize_int2(weight, group_size=group)
    qw.validate()
    approx = dequantize_int2(qw)
    assert approx.shape == weight.shape
    # Per group, |w - dequant(w)| <= scale / 2 (plus fp16 rounding of scale and min).
    padded = torch.zeros(shape[0], qw.padded_in)
    padded[:, : shape[1]] = (weight - approx).abs()
    err = padded.view(shape[0], -1, group).amax(-1)
    bound = qw.scales.float() / 2 + 2e-3 * (weight.abs().max() + 1)
    assert torch.all(err <= bound)


def test_reference_matmul_equals_dense_matmul_with_dequantized_weight():
    torch.manual_seed(1)
    weight, x = torch.randn(50, 200), torch.randn(3, 7, 200)
    qw = quantize_int2(weight, group_size=64)
    expected = x @ dequantize_int2(qw).T
    torch.testing.assert_close(int2_matmul_reference(x, qw, rows_per_chunk=16), expected)


@pytest.mark.parametrize("group", [0, -4, 6, 3])
def test_bad_group_size_is_a_clear_error(group):
    with pytest.raises(QuantError, match="group_size"):
        quantize_int2(torch.randn(4, 16), group_size=group)


def test_mismatched_tensors_are_refused():
    qw = quantize_int2(torch.randn(8, 128), group_size=64)
    truncated = Int2Weight(qw.packed[:, :10], qw.scales, qw.mins, qw.in_features, qw.group_size)
    with pytest.raises(QuantError, match="truncated"):
        truncated.validate()
    wrong_scales = Int2Weight(qw.packed, qw.scales[:, :1], qw.mins, qw.in_features, qw.group_size)
    with pytest.raises(QuantError, match="scales"):
        wrong_scales.validate()


def test_int2_linear_matches_its_dequantized_weight_and_keeps_no_float_weight():
    torch.manual_seed(2)
    linear = torch.nn.Linear(96, 40)
    qlinear = Int2Linear.from_linear(linear, group_size=32)
    assert not any(t.dtype == torch.float32 and t.numel() >= 96 * 40 for t in qlinear.state_dict().values())
    x = torch.randn(5, 96)
    expected = x @ dequantize_int2(qlinear.qweight).T + linear.bias
    torch.testing.assert_close(qlinear(x), expected)


TRITON_CHECK = r"""
import torch
from vllm_mtpspec.quant import quantize_int2, int2_matmul_reference
from vllm_mtpspec.quant.triton_int2 import int2_matmul_triton
torch.manual_seed(0)
for (m, n, k, g) in [(1, 40, 128, 64), (5, 64, 200, 32), (17, 33, 96, 16), (3, 70, 64, 64)]:
    qw = quantize_int2(torch.randn(n, k), group_size=g)
    x = torch.randn(m, k)
    got = int2_matmul_triton(x, qw)
    want = int2_matmul_reference(x, qw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
print("triton-ok")
"""


def test_triton_kernel_matches_reference_under_the_interpreter():
    run_under_triton_interpreter(TRITON_CHECK, "triton-ok")
