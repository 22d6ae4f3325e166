import pytest
import torch

from vllm_mtpspec.config import HeadsConfig
from vllm_mtpspec.heads import MTPHeads


def make_heads(**overrides) -> MTPHeads:
    config = dict(num_heads=3, hidden_size=16, vocab_size=40, tied=True)
    config.update(overrides)
    return MTPHeads(HeadsConfig(**config))


class CountingLMHead(torch.nn.Module):
    def __init__(self, d, vocab):
        super().__init__()
        self.linear = torch.nn.Linear(d, vocab, bias=False)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.linear(x)


def test_zero_initialised_heads_start_as_the_lm_head():
    heads = make_heads()
    lm_head = CountingLMHead(16, 40)
    h = torch.randn(5, 16)
    logits = heads(h, lm_head=lm_head)
    assert logits.shape == (5, 3, 40)
    for i in range(3):
        torch.testing.assert_close(logits[:, i], lm_head.linear(h))


def test_tied_heads_use_one_lm_head_call_for_all_heads():
    torch.manual_seed(0)
    heads = make_heads()
    torch.nn.init.normal_(heads.block.weight, std=0.1)
    lm_head = CountingLMHead(16, 40)
    h = torch.randn(2, 4, 16)
    logits = heads(h, lm_head=lm_head)
    assert lm_head.calls == 1
    # Head i's logits equal LM head of h + SiLU(W_i h + b_i), computed head by head.
    d = 16
    for i in range(3):
        w, b = heads.block.weight[i * d:(i + 1) * d], heads.block.bias[i * d:(i + 1) * d]
        expected = lm_head.linear(h + torch.nn.functional.silu(h @ w.T + b))
        torch.testing.assert_close(logits[..., i, :], expected)


def test_untied_batched_projection_equals_each_head_alone():
    torch.manual_seed(1)
    heads = make_heads(tied=False)
    for proj in heads.proj:
        torch.nn.init.normal_(proj.weight)
    torch.nn.init.normal_(heads.block.weight, std=0.1)
    h = torch.randn(3, 16)
    logits = heads(h)
    hidden = heads.hidden(h)
    for i, proj in enumerate(heads.proj):
        torch.testing.assert_close(logits[:, i], proj(hidden[:, i]))


def test_token_conditioned_heads_need_and_use_the_token_embedding():
    torch.manual_seed(2)
    heads = make_heads(head_input="hidden+token", embed_scale=3.0)
    torch.nn.init.normal_(heads.block.weight, std=0.1)
    lm_head = CountingLMHead(16, 40)
    h, e1, e2 = torch.randn(2, 16), torch.randn(2, 16), torch.randn(2, 16)
    with pytest.raises(ValueError, match="token-conditioned"):
        heads(h, lm_head=lm_head)
    assert heads.block.in_features == 32
    a = heads(h, token_embeds=e1, lm_head=lm_head)
    b = heads(h, token_embeds=e2, lm_head=lm_head)
    assert not torch.allclose(a, b)
    u = torch.cat([h, 3.0 * e1], -1)
    expected0 = lm_head.linear(h + torch.nn.functional.silu(u @ heads.block.weight[:16].T + heads.block.bias[:16]))
    torch.testing.assert_close(a[:, 0], expected0)


def test_heads_with_a_hidden_layer_start_as_the_lm_head_and_compute_each_head_alone():
    torch.manual_seed(5)
    heads = make_heads(head_input="hidden+token", embed_scale=2.0, mlp_size=24)
    assert heads.block.out_features == 3 * 24 and [d.weight.shape for d in heads.down] == [(16, 24)] * 3
    lm_head = CountingLMHead(16, 40)
    h, e = torch.randn(4, 16), torch.randn(4, 16)
    untrained = heads(h, token_embeds=e, lm_head=lm_head)
    for i in range(3):
        torch.testing.assert_close(untrained[:, i], lm_head.linear(h))
    for down in heads.down:
        torch.nn.init.normal_(down.weight, std=0.1)
    logits = heads(h, token_embeds=e, lm_head=lm_head)
    assert lm_head.calls == 2  # still one LM-head call for all heads
    u = torch.cat([h, 2.0 * e], -1)
    for i in range(3):
        w, b = heads.block.weight[i * 24:(i + 1) * 24], heads.block.bias[i * 24:(i + 1) * 24]
        z = h + torch.nn.functional.silu(u @ w.T + b) @ heads.down[i].weight.T
        torch.testing.assert_close(logits[:, i], lm_head.linear(z))


@pytest.mark.parametrize("tied,mlp_size", [(True, 0), (False, 0), (True, 96)])
def test_quantized_heads_follow_the_full_precision_heads(tied, mlp_size):
    torch.manual_seed(3)
    heads = make_heads(tied=tied, hidden_size=64, vocab_size=50, mlp_size=mlp_size)
    torch.nn.init.normal_(heads.block.weight, std=0.05)
    for down in heads.down or []:
        torch.nn.init.normal_(down.weight, std=0.05)
    if not tied:
        for proj in heads.proj:
            torch.nn.init.normal_(proj.weight, std=0.05)
    lm_head = CountingLMHead(64, 50)
    qheads = heads.quantized(group_size=32)
    assert qheads.is_quantized and qheads.config.quantization.group_size == 32
    h = torch.randn(4, 64)
    full, quant = heads(h, lm_head=lm_head), qheads(h, lm_head=lm_head)
    assert quant.shape == full.shape
    rel = (full - quant).norm() / full.norm()
    # Four levels per group of Gaussian weights leave ~0.4 relative error per matmul;
    # unrelated outputs would be ~1.4 apart.
    assert rel < 0.5
    assert qheads.nbytes() < heads.nbytes() / 5


@pytest.mark.parametrize("quantized", [False, True])
def test_untied_heads_project_a_shallower_draft_with_their_first_heads(quantized):
    torch.manual_seed(4)
    heads = make_heads(tied=False, hidden_size=64, vocab_size=50)
    for proj in heads.proj:
        torch.nn.init.normal_(proj.weight, std=0.05)
    if quantized:
        heads = heads.quantized(group_size=32)
    hidden = heads.hidden(torch.randn(4, 64))
    full = heads.project(hidden)
    shallow = heads.project(hidden[:, :1])
    assert shallow.shape == (4, 1, 50)
    torch.testing.assert_close(shallow[:, 0], full[:, 0])
