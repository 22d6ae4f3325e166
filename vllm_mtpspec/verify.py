"""Lossless verification of draft chains and trees.

The target scored the root and every node in one pass: row 0 of its logits/probs is its
distribution after the root, row j + 1 after node j. Verification walks down from the
root and returns the accepted nodes and the tokens to emit (the accepted nodes' tokens
plus one more from the target: the bonus).

Greedy: follow the child whose token equals the target's argmax; the output is exactly
the target's own greedy output.

Sampled, deterministic candidates (tree presets): at a node, try its children in rank
order; accept child c with probability p(c), else zero p(c) and renormalise; when every
child fails, sample from what is left. Equivalent to drawing x ~ p and looking for it
among the children, so the emitted token is distributed exactly as p.

Sampled drafts (each child drawn from the head's distribution q, independently): accept
c with min(1, p(c) / q(c)); on rejection p <- norm(max(p - q, 0)) (SpecInfer's multi-draft
rule; for a chain it is the standard speculative sampling rule).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_mtpspec.tree import TreeShape


@dataclass
class Verdict:
    accepted_nodes: list[int]  # node indices from the root down
    emitted: list[int]         # accepted tokens + the bonus token

    @property
    def accepted_len(self) -> int:
        """Tokens emitted this step (accepted drafts + 1)."""
        return len(self.emitted)


def verify_greedy(shape: TreeShape, node_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """target_logits [n + 1, V] -> the longest path that equals the target's argmax."""
    best = target_logits.argmax(dim=-1).tolist()
    tokens = node_tokens.tolist()
    accepted: list[int] = []
    row = 0
    while True:
        match = next((c for c in shape.children[row] if tokens[c] == best[row]), None)
        if match is None:
            break
        accepted.append(match)
        row = match + 1
    return Verdict(accepted, [tokens[a] for a in accepted] + [best[row]])


def verify_sampled(
    shape: TreeShape,
    node_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    *,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Verdict:
    """target_probs [n + 1, V]: the target's (temperature, top-p ... applied) distributions.

    draft_probs None: the nodes are deterministic candidates (top-k of the heads).
    draft_probs [k, V]: every child at depth d was drawn from draft_probs[d - 1].
    """
    tokens = node_tokens.tolist()
    accepted: list[int] = []
    row = 0
    while True:
        p = target_probs[row].double().clone()
        kids = shape.children[row]
        match = None
        for child in kids:
            c = tokens[child]
            if draft_probs is None:
                accept_prob = float(p[c])
            else:
                q = draft_probs[shape.depths[child] - 1].double()
                accept_prob = min(1.0, float(p[c]) / max(float(q[c]), 1e-30))
            if _uniform(generator) < accept_prob:
                match = child
                break
            if draft_probs is None:
                p[c] = 0.0
            else:
                p = torch.clamp(p - q, min=0.0)
            total = float(p.sum())
            if total <= 0.0:
                # Nothing is left to sample: happens only when the candidates already
                # covered all of p's mass, in which case one was accepted almost surely.
                p = target_probs[row].double().clone()
                break
            p /= total
        if match is None:
            bonus = int(torch.multinomial(p.float(), 1, generator=generator))
            return Verdict(accepted, [tokens[a] for a in accepted] + [bonus])
        accepted.append(match)
        row = match + 1


def _uniform(generator: torch.Generator | None) -> float:
    # On the generator's own device: a CUDA generator cannot draw a CPU tensor.
    device = None if generator is None else generator.device
    return float(torch.rand((), generator=generator, dtype=torch.float64, device=device))
