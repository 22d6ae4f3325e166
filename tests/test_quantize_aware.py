"""Quantization-aware fine-tuning of INT2 heads: fake-quantized weights that pack into the
usual format, and the training config's INT2 copy."""
import numpy as np
import pytest
import torch
from torch import nn

from vllm_mtpspec.quant import dequantize_int2, quantize_int2
from vllm_mtpspec.quant.fake_int2 import attach, pack
from vllm_mtpspec_train.config import TrainConfig, TrainConfigError


def test_a_weight_on_its_codes_packs_back_to_the_same_bytes_and_gradients_reach_the_ranges():
    torch.manual_seed(0)
    linear = nn.Linear(100, 8, bias=False)
    init = quantize_int2(linear.weight.detach(), group_size=32)
    with torch.no_grad():
        linear.weight.copy_(dequantize_int2(init))
    fake = attach(linear, init)
    torch.testing.assert_close(linear.weight, dequantize_int2(init))
    packed = pack(linear)
    assert torch.equal(packed.packed[:, :25], init.packed[:, :25])  # the real inputs' codes
    assert torch.equal(packed.scales, init.scales) and torch.equal(packed.mins, init.mins)
    # On the grid, the ranges' gradients are rounding noise (the straight-through estimator
    # gives a group's minimum no gradient from weights inside its range). Move the weights
    # off it, each within its code (the scales learn from that), and push the first column
    # below its group's minimum, clamped to code 0 (the minimums learn from that).
    with torch.no_grad():
        original = linear.parametrizations.weight.original
        scale = init.scales.float().repeat_interleave(32, dim=1)[:, :100]
        original.add_(scale * (torch.rand(original.shape) - 0.5) * 0.6)
        original[:, 0] = init.mins.float()[:, 0] - scale[:, 0]
    linear(torch.randn(4, 100)).pow(2).sum().backward()
    assert (fake.scale.grad != 0).all() and (fake.low.grad[:, 0] != 0).all()
    assert linear.parametrizations.weight.original.grad.abs().sum() > 0


def examples_for(heads, n=600, seed=0):
    gen = torch.Generator().manual_seed(seed)
    vocab, k = heads.config.vocab_size, heads.num_heads
    return {"hidden": torch.randn(n, heads.config.hidden_size, generator=gen).numpy().astype(np.float16),
            "token": torch.randint(0, vocab, (n,), generator=gen).numpy(),
            "targets": torch.randint(0, vocab, (n, k), generator=gen).numpy(),
            "teacher_ids": torch.randint(0, vocab, (n, k, 4), generator=gen).int().numpy(),
            "teacher_logprobs": torch.log_softmax(torch.randn(n, k, 4, generator=gen), -1).numpy()}


def test_quantize_aware_steps_lower_the_loss_of_the_int2_heads(tiny_model, tiny_model_dir, tmp_path):
    from vllm_mtpspec.checkpoint import load_heads, save_heads
    from vllm_mtpspec.heads_init import init_heads
    from vllm_mtpspec_train.modules import PosthocModule
    from vllm_mtpspec_train.quantize_aware import quantize_aware

    heads = init_heads(tiny_model, tiny_model_dir, num_heads=2, head_input="hidden+token", mlp_size=64,
                       init_std=0.05, seed=0).float()
    embed = tiny_model.get_input_embeddings().weight.detach()
    lm_head = tiny_model.get_output_embeddings().weight.detach()
    examples = examples_for(heads)

    def loss(candidate):
        module = PosthocModule(candidate.float(), lm_head=lm_head, embed=embed, num_negatives=0, kl_weight=1.0)
        with torch.no_grad():
            return module({key: value for key, value in examples.items()})[0].item()

    zero_steps = quantize_aware(heads, examples, lm_head=lm_head, embed=embed, steps=0, num_negatives=0)
    tuned = quantize_aware(heads, examples, lm_head=lm_head, embed=embed, steps=60, lr=3e-3, num_negatives=0)
    assert tuned.is_quantized and tuned.config.quantization.method == "qat"
    assert loss(tuned) < loss(zero_steps)
    loaded = load_heads(save_heads(tuned, tmp_path / "qat"))
    h, e = torch.randn(3, heads.config.hidden_size), embed[:3]
    torch.testing.assert_close(loaded(h, token_embeds=e, lm_head=lambda x: x @ lm_head.T),
                               tuned(h, token_embeds=e, lm_head=lambda x: x @ lm_head.T))


def test_the_training_config_refuses_int2_options_that_cannot_apply():
    with pytest.raises(TrainConfigError, match="int2_method='awq'"):
        TrainConfig(int2_method="awq")
    with pytest.raises(TrainConfigError, match="set int2_group_size"):
        TrainConfig(quantize_aware_steps=100, int2_group_size=None)
    with pytest.raises(TrainConfigError, match="use int2_method 'rtn' in cotrain mode"):
        TrainConfig(mode="cotrain", student="s", int2_method="gptq")


def test_with_no_steps_the_result_is_gptqs(tiny_model, tiny_model_dir):
    from vllm_mtpspec.heads_init import init_heads
    from vllm_mtpspec.heads_quant import quantize_heads
    from vllm_mtpspec_train.quantize_aware import quantize_aware, statistics_from_examples

    heads = init_heads(tiny_model, tiny_model_dir, num_heads=2, head_input="hidden+token", mlp_size=64,
                       init_std=0.05, seed=1).float()
    embed = tiny_model.get_input_embeddings().weight.detach()
    lm_head = tiny_model.get_output_embeddings().weight.detach()
    examples = examples_for(heads, seed=4)
    statistics, _ = statistics_from_examples(heads, examples, embed, lm_head)
    gptq = quantize_heads(heads, method="gptq", statistics=statistics)
    untouched = quantize_aware(heads, examples, lm_head=lm_head, embed=embed, steps=0, statistics=statistics)
    for (name, a), b in zip(gptq.state_dict().items(), untouched.state_dict().values()):
        if name.endswith("packed"):
            codes_differ = (a != b).float().mean().item()
            assert codes_differ < 0.01, (name, codes_differ)
        else:
            torch.testing.assert_close(a, b, msg=name)
