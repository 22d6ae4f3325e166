"""Losses: L = L_KD(student || teacher) + lambda * sum_i L_MTP(i).

L_MTP(i) = cross-entropy on the target's token i + 1 steps ahead + KL from the target's
top-k distribution there. Both are computed over a candidate set, not the whole
vocabulary: the batch's target tokens and teacher candidates plus a few thousand random
negatives. A 49k-way projection for every head and row is what makes CPU training slow;
the candidate set keeps its cost small while still pushing down tokens outside the top-k.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class HeadLosses:
    total: torch.Tensor          # scalar, summed over heads
    ce: list[float]              # per head
    kl: list[float]              # per head


def candidate_set(targets: torch.Tensor, teacher_ids: torch.Tensor, vocab_size: int, num_negatives: int,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    ids = torch.cat([targets[targets >= 0].flatten(), teacher_ids[teacher_ids >= 0].flatten().long()])
    if num_negatives > 0:
        ids = torch.cat([ids, torch.randint(0, vocab_size, (num_negatives,), generator=generator, device=ids.device)])
    return torch.unique(ids)  # sorted


def mtp_losses(
    head_hidden: torch.Tensor,      # [B, k, d]
    projection: torch.Tensor | list[torch.Tensor],  # [V, d] (tied), or k of them (untied)
    targets: torch.Tensor,          # [B, k] token ids, -1 = none
    teacher_ids: torch.Tensor,      # [B, k, K], -1 = none
    teacher_logprobs: torch.Tensor, # [B, k, K]
    *,
    num_negatives: int = 2048,
    kl_weight: float = 1.0,
    depth_decay: float = 1.0,
    generator: torch.Generator | None = None,
) -> HeadLosses:
    """depth_decay: head i's losses weigh depth_decay ** i in the total (1: all alike).
    A chain keeps a deep draft only when every shallower one was right, so the shallow
    heads are worth more (EAGLE-3 weighs depth i by 0.8 ** i)."""
    tied = isinstance(projection, torch.Tensor)
    vocab = (projection if tied else projection[0]).shape[0]
    cand = candidate_set(targets, teacher_ids, vocab, num_negatives, generator)       # [C]
    if tied:
        logits = head_hidden @ projection[cand].T.to(head_hidden.dtype)                 # [B, k, C]
    else:
        # Each head's candidate rows only: stacking whole [V, d] projections first would
        # copy (and back-propagate through) every row, ~100x the work at these sizes.
        rows = torch.stack([weight[cand] for weight in projection]).to(head_hidden.dtype)  # [k, C, d]
        logits = torch.einsum("bkd,kcd->bkc", head_hidden, rows)
    logq = F.log_softmax(logits.float(), dim=-1)
    valid = targets >= 0                                                                 # [B, k]
    target_idx = torch.searchsorted(cand, targets.clamp_min(0))
    ce = -logq.gather(-1, target_idx.unsqueeze(-1)).squeeze(-1)                          # [B, k]
    t_valid = teacher_ids >= 0
    t_idx = torch.searchsorted(cand, teacher_ids.long().clamp_min(0))
    p_teacher = torch.softmax(teacher_logprobs.float().masked_fill(~t_valid, float("-inf")), dim=-1)
    p_teacher = torch.nan_to_num(p_teacher) * t_valid
    kl = (p_teacher * (torch.log(p_teacher.clamp_min(1e-12)) - logq.gather(-1, t_idx))).sum(-1)  # [B, k]
    denom = valid.sum(0).clamp_min(1)
    ce_head = (ce * valid).sum(0) / denom
    kl_head = (kl * valid).sum(0) / denom
    weights = depth_decay ** torch.arange(ce_head.shape[0], device=ce_head.device, dtype=ce_head.dtype)
    total = (weights * (ce_head + kl_weight * kl_head)).sum()
    return HeadLosses(total, ce_head.tolist(), kl_head.tolist())


def kd_loss(student_logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor,
            valid: torch.Tensor) -> torch.Tensor:
    """KL(teacher top-k || student) per position over the student's full vocabulary."""
    logp = F.log_softmax(student_logits.float(), dim=-1)
    t_valid = teacher_ids >= 0
    p_teacher = torch.nan_to_num(torch.softmax(teacher_logprobs.float().masked_fill(~t_valid, float("-inf")), -1)) * t_valid
    kl = (p_teacher * (torch.log(p_teacher.clamp_min(1e-12)) - logp.gather(-1, teacher_ids.long().clamp_min(0)))).sum(-1)
    return (kl * valid).sum() / valid.sum().clamp_min(1)
