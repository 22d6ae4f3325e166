"""Tree verification inside vLLM's sampling step.

vLLM's rejection sampler checks every request's drafts as a chain. For the requests on
the tree path this step, its rows are replaced by the core's lossless tree rules
(verify.py): greedy follows the target's argmax through the tree; sampled tries a node's
children in rank order against the target's distribution after temperature, top-k and
top-p, exactly as vLLM would have processed it. Each request's logits rows are the root's
and then one per node, in the order vLLM laid them out (num_drafts + 1 per request).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_mtpspec.verify import Verdict, verify_greedy, verify_sampled
from vllm_mtpspec.vllm.tree_step import TreeStep

SAMPLING_EPS = 1e-5  # vLLM's own threshold below which a temperature means greedy
PLACEHOLDER_TOKEN_ID = -1  # what vLLM's rejection sampler leaves in unused slots


@dataclass(frozen=True)
class RowSampling:
    """One request's sampling parameters, as vLLM's SamplingMetadata holds them."""

    temperature: float
    top_k: int | None
    top_p: float | None
    generator: torch.Generator | None

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def row_sampling(sampling_metadata, batch_index: int) -> RowSampling:
    if sampling_metadata.all_greedy or sampling_metadata.temperature is None:
        return RowSampling(0.0, None, None, None)
    top_k = sampling_metadata.top_k
    top_p = sampling_metadata.top_p
    return RowSampling(
        temperature=float(sampling_metadata.temperature[batch_index]),
        top_k=None if top_k is None else int(top_k[batch_index]),
        top_p=None if top_p is None else float(top_p[batch_index]),
        generator=sampling_metadata.generators.get(batch_index),
    )


def target_probs(logits: torch.Tensor, sampling: RowSampling) -> torch.Tensor:
    """logits [rows, V] -> the distributions vLLM would sample from (temperature, then
    top-k / top-p through vLLM's own function)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    scaled = logits.float() / sampling.temperature
    rows = scaled.shape[0]
    k = None if sampling.top_k is None else torch.full((rows,), sampling.top_k, dtype=torch.int32)
    p = None if sampling.top_p is None else torch.full((rows,), sampling.top_p, dtype=torch.float32)
    return torch.softmax(apply_top_k_top_p(scaled, k, p), dim=-1)


def verify_tree_requests(
    step: TreeStep,
    logits: torch.Tensor,
    num_draft_tokens: list[int],
    sampling_metadata,
    sampled_token_ids: torch.Tensor,
) -> dict[int, Verdict]:
    """Overwrite the tree requests' rows of sampled_token_ids [num_reqs, max_spec + 1]
    (vLLM's rejection sampler output) with tree verdicts; returns them by batch index."""
    row_starts = [0]
    for n in num_draft_tokens:
        row_starts.append(row_starts[-1] + n + 1)
    verdicts = {}
    for tree in step.trees:
        i = tree.batch_index
        rows = logits[row_starts[i]: row_starts[i] + tree.num_query_tokens]
        tokens = torch.tensor(tree.tokens)
        sampling = row_sampling(sampling_metadata, i)
        if sampling.greedy:
            verdict = verify_greedy(tree.shape, tokens, rows)
        else:
            verdict = verify_sampled(tree.shape, tokens, target_probs(rows, sampling), generator=sampling.generator)
        sampled_token_ids[i].fill_(PLACEHOLDER_TOKEN_ID)
        sampled_token_ids[i, : len(verdict.emitted)] = torch.tensor(verdict.emitted, dtype=sampled_token_ids.dtype)
        verdicts[i] = verdict
    return verdicts
