"""Shared statistics for the tests that check a sampler keeps the target's distribution."""
import numpy as np
import torch
from scipy.stats import chisquare

VOCAB = 6
TRIALS = 12000
ALPHA = 1e-3


def random_dists(rows, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, VOCAB, generator=gen) * 1.5, -1)


def assert_follows(samples, probs):
    counts = np.bincount(np.asarray(samples), minlength=len(probs))
    expected = probs.double().numpy() * len(samples)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "emitted a token the target gives probability 0"
    stat = chisquare(counts[keep], expected[keep] * counts[keep].sum() / expected[keep].sum())
    assert stat.pvalue > ALPHA, f"counts {counts} vs expected {np.round(expected)}: p={stat.pvalue:.2e}"
