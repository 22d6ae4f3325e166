"""The vLLM proposer's own logic, without an engine: which hidden state each request
drafts from, and how adaptive depth cuts drafts per request and per batch."""
from types import SimpleNamespace

import pytest
import torch

from vllm_mtpspec.checkpoint import save_heads
from vllm_mtpspec.heads_init import init_heads
from vllm_mtpspec.vllm.rows import last_sampled_rows


def test_rows_without_and_with_drafts():
    # No request carried drafts: one row each; a partial prefill sampled nothing.
    assert last_sampled_rows([[5], [], [7]], None, 3) == [(0, 0), (2, 2)]
    # Drafts 2, 0, 3 -> rows [0..2], [3], [4..7]; accepted 2, 1 and 4 tokens.
    assert last_sampled_rows([[1, 2], [3], [4, 5, 6, 7]], [2, 0, 3], 8) == [(0, 1), (1, 3), (2, 7)]
    # Metadata present, but nobody had drafts this step.
    assert last_sampled_rows([[1], [2]], [0, 0], 2) == [(0, 0), (1, 1)]


@pytest.fixture
def proposer(tiny_model, tiny_model_dir, tmp_path):
    from vllm_mtpspec.vllm.proposer import MTPSpecProposer

    heads = init_heads(tiny_model, tiny_model_dir, num_heads=3, init_std=0.5, seed=3)
    heads_dir = save_heads(heads, tmp_path / "heads")
    config = SimpleNamespace(
        additional_config={"mtpspec": {"heads": str(heads_dir), "min_path_prob": 0.0, "batch_backoff_start": 4}},
        model_config=SimpleNamespace(model=str(tiny_model_dir), hf_text_config=tiny_model.config, dtype=torch.float32),
        speculative_config=SimpleNamespace(num_speculative_tokens=3),
        device_config=SimpleNamespace(device="cpu"),
    )
    p = MTPSpecProposer(config)
    target = SimpleNamespace(compute_logits=tiny_model.get_output_embeddings(),
                             embed_input_ids=tiny_model.get_input_embeddings())
    p.load_model(target)
    return p, heads, tiny_model


def expected_chain(heads, model, h):
    logits = heads(h[None], lm_head=model.get_output_embeddings())[0]
    return logits.argmax(-1).tolist()


def test_drafts_come_from_each_requests_last_accepted_row(proposer):
    p, heads, model = proposer
    hidden = torch.randn(6, model.config.hidden_size)
    meta = SimpleNamespace(num_draft_tokens=[2, 0, 2])
    p.capture_step(hidden, meta)
    drafts = p.propose([[11, 12], [13], []])  # third: a partial prefill
    assert drafts[0] == expected_chain(heads, model, hidden[1])
    assert drafts[1] == expected_chain(heads, model, hidden[3])
    assert drafts[2] == []


def test_adaptive_depth_per_request_and_per_batch(proposer):
    p, heads, model = proposer
    hidden = torch.randn(1, model.config.hidden_size)
    p.capture_step(hidden, None)
    full = p.propose([[1]])[0]
    assert len(full) == 3
    p.options.min_path_prob = 0.999  # no random head is that sure: nothing is drafted
    p.capture_step(hidden, None)
    assert p.propose([[1]]) == [[]]
    assert [p.depth_for_batch(n) for n in (1, 4, 5, 8, 9, 16, 32)] == [3, 3, 2, 2, 1, 1, 0]
