"""The heads' training losses over a candidate set of the vocabulary."""
import torch
import torch.nn.functional as F

from vllm_mtpspec_train.losses import candidate_set, mtp_losses

B, K, D, V, TOPK = 6, 3, 8, 64, 4


def example(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, K, D, generator=g)
    targets = torch.randint(0, V, (B, K), generator=g)
    targets[0, 2] = -1  # past the end of an answer: ignored
    teacher_ids = torch.randint(0, V, (B, K, TOPK), generator=g).int()
    teacher_lp = torch.log_softmax(torch.randn(B, K, TOPK, generator=g), dim=-1)
    return hidden, targets, teacher_ids, teacher_lp


def test_with_every_token_a_candidate_the_loss_is_full_vocabulary_cross_entropy():
    hidden, targets, teacher_ids, teacher_lp = example()
    projection = torch.randn(V, D)
    # 4096 random negatives out of 20 tokens: the candidate set is the whole vocabulary.
    losses = mtp_losses(hidden, projection, targets, teacher_ids, teacher_lp, num_negatives=4096, kl_weight=0.0,
                        generator=torch.Generator().manual_seed(1))
    logits = hidden @ projection.T
    for i in range(K):
        valid = targets[:, i] >= 0
        expected = F.cross_entropy(logits[valid, i], targets[valid, i])
        assert abs(losses.ce[i] - expected.item()) < 1e-5


def test_untied_projections_equal_to_the_tied_one_give_the_same_loss_and_touch_only_candidates():
    hidden, targets, teacher_ids, teacher_lp = example(seed=2)
    tied = torch.randn(V, D)
    untied = [tied.clone().requires_grad_(True) for _ in range(K)]
    kwargs = dict(num_negatives=2, kl_weight=1.0)
    a = mtp_losses(hidden, tied, targets, teacher_ids, teacher_lp, generator=torch.Generator().manual_seed(3), **kwargs)
    b = mtp_losses(hidden, untied, targets, teacher_ids, teacher_lp, generator=torch.Generator().manual_seed(3), **kwargs)
    assert torch.allclose(a.total, b.total)
    b.total.backward()
    candidates = set(candidate_set(targets, teacher_ids, V, 2, torch.Generator().manual_seed(3)).tolist())
    assert len(candidates) < V  # so that the check below can fail
    for weight in untied:
        touched = set(torch.nonzero(weight.grad.abs().sum(-1)).flatten().tolist())
        assert touched == candidates


def test_depth_decay_weighs_deeper_heads_less():
    hidden, targets, teacher_ids, teacher_lp = example(seed=4)
    projection = torch.randn(V, D)
    kwargs = dict(num_negatives=8, kl_weight=0.5)
    alike = mtp_losses(hidden, projection, targets, teacher_ids, teacher_lp,
                       generator=torch.Generator().manual_seed(5), **kwargs)
    decayed = mtp_losses(hidden, projection, targets, teacher_ids, teacher_lp, depth_decay=0.5,
                         generator=torch.Generator().manual_seed(5), **kwargs)
    per_head = [ce + 0.5 * kl for ce, kl in zip(alike.ce, alike.kl)]
    assert abs(alike.total.item() - sum(per_head)) < 1e-4
    assert abs(decayed.total.item() - sum(0.5 ** i * v for i, v in enumerate(per_head))) < 1e-4
    assert decayed.ce == alike.ce  # the reported per-head losses stay unweighted
