"""Tree verification inside vLLM's sampling step.

vLLM's rejection sampler checks every request's drafts as a chain. For the requests on
the tree path this step, its rows are replaced by the core's lossless tree rules
(batched_verify.py): greedy follows the target's argmax through the tree; sampled tries a
node's children in rank order against the target's distribution after temperature, top-k
and top-p, processed by vLLM's own function exactly as vLLM would. Each request's logits
rows are the root's and then one per node, in the order vLLM laid them out
(num_drafts + 1 per request).

Device-correct by construction: every tensor is made on the logits' device, seeded
requests draw from their own generator on its device (vLLM's are CUDA generators on a
GPU), all requests are verified together, and the verdicts are read back once per step.
"""
from __future__ import annotations

import torch

from vllm_mtpspec.batched_verify import (
    TreeBatch,
    draw_uniforms,
    emitted_tokens,
    greedy_hits,
    read_verdicts,
    residual_draw,
    sampled_hits,
    stop_rows,
    walk,
)
from vllm_mtpspec.verify import Verdict
from vllm_mtpspec.vllm.tree_step import TreeStep

SAMPLING_EPS = 1e-5  # vLLM's own threshold below which a temperature means greedy
PLACEHOLDER_TOKEN_ID = -1  # what vLLM's rejection sampler leaves in unused slots


def processed_probs(logits: torch.Tensor, request_of_row: torch.Tensor, sampling_metadata) -> torch.Tensor:
    """logits [R, V], request_of_row [R] (batch indices, on logits' device) -> the
    distributions vLLM would sample from: temperature, then top-k / top-p through vLLM's
    own function, with each row's request's parameters."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    temperature = sampling_metadata.temperature[request_of_row].to(torch.float32)
    # Greedy rows of a mixed batch carry temperature 0: keep them finite (they take the argmax).
    temperature = torch.where(temperature < SAMPLING_EPS, torch.ones_like(temperature), temperature)
    scaled = logits.float() / temperature[:, None]
    top_k = None if sampling_metadata.top_k is None else sampling_metadata.top_k[request_of_row]
    top_p = None if sampling_metadata.top_p is None else sampling_metadata.top_p[request_of_row]
    return torch.softmax(apply_top_k_top_p(scaled, top_k, top_p), dim=-1)


def tree_logits(logits: torch.Tensor, step: TreeStep, num_draft_tokens: list[int]) -> torch.Tensor:
    """The tree requests' rows of vLLM's logits, in TreeBatch order (a view where they
    are one contiguous block, as when every drafted request is on the tree path)."""
    row_starts = [0]
    for n in num_draft_tokens:
        row_starts.append(row_starts[-1] + n + 1)
    rows = [r for tree in step.trees for r in range(row_starts[tree.batch_index],
                                                      row_starts[tree.batch_index] + tree.num_query_tokens)]
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return logits[rows[0]: rows[0] + len(rows)]
    return logits[torch.tensor(rows, device=logits.device)]


def verify_tree_requests(
    step: TreeStep,
    logits: torch.Tensor,
    num_draft_tokens: list[int],
    sampling_metadata,
    sampled_token_ids: torch.Tensor,
) -> dict[int, Verdict]:
    """Overwrite the tree requests' rows of sampled_token_ids [num_reqs, max_spec + 1]
    (vLLM's rejection sampler output) with tree verdicts; returns them by batch index."""
    if not step:
        return {}
    device = logits.device
    batch = TreeBatch.of([(tree.shape, tree.tokens) for tree in step.trees])
    batch_indices = [tree.batch_index for tree in step.trees]
    edges = batch.on(device)
    rows = tree_logits(logits, step, num_draft_tokens)
    all_greedy = sampling_metadata.all_greedy or sampling_metadata.temperature is None
    argmax = None if getattr(sampling_metadata, "all_random", False) and not all_greedy else rows.argmax(dim=-1)
    if all_greedy:
        hits = greedy_hits(edges, argmax)
        walked, accepted = walk(batch, edges, hits)
        bonus = argmax[stop_rows(walked, accepted)]
    else:
        request_of_row = torch.tensor([i for t, i in enumerate(batch_indices) for _ in batch.tree_rows(t)],
                                      device=device)
        probs = processed_probs(rows, request_of_row, sampling_metadata)
        seeded = [(t, sampling_metadata.generators[i]) for t, i in enumerate(batch_indices)
                  if i in sampling_metadata.generators]
        uniforms = draw_uniforms(batch.num_rows, device, [(batch.tree_rows(t), g) for t, g in seeded])
        hits = sampled_hits(edges, probs, uniforms)
        greedy_row = sampling_metadata.temperature[request_of_row] < SAMPLING_EPS
        if argmax is not None:
            hits = torch.where(greedy_row[edges.parents], greedy_hits(edges, argmax), hits)
        walked, accepted = walk(batch, edges, hits)
        stops = stop_rows(walked, accepted)
        bonus_uniforms = draw_uniforms(len(batch_indices), device, [(range(t, t + 1), g) for t, g in seeded])
        bonus = residual_draw(batch, edges, probs, stops, bonus_uniforms)
        if argmax is not None:
            bonus = torch.where(greedy_row[stops], argmax[stops], bonus)
    emitted = emitted_tokens(edges, walked, accepted, bonus)
    targets = torch.tensor(batch_indices, device=sampled_token_ids.device)
    sampled_token_ids[targets] = PLACEHOLDER_TOKEN_ID
    sampled_token_ids[targets, : emitted.shape[1]] = emitted.to(sampled_token_ids.device, sampled_token_ids.dtype)
    return dict(zip(batch_indices, read_verdicts(batch, emitted, walked)))
