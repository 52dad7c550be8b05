"""DSpark's loss (models/methods/dflash/dspark_training.py dspark_loss), the speculators library's term for term: the
KL of the target (one-hot: the distilled token's cross-entropy; with teacher_loss_weight the base's distribution)
and the confidence head's BCE against 1 - TV, each summed with the position weights and divided by the count of
trained slots plus the library's eps (not by the weights' sum, as DFlash's loss is)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.methods.dflash.dspark_training import CONFIDENCE_EPS, KL_EPS, dspark_loss


def slots(seed=0, V=11):
    g = torch.Generator().manual_seed(seed)
    logits, teacher = torch.randn(2, 3, V, generator=g), 2 * torch.randn(2, 3, V, generator=g)
    confidence, index = torch.randn(2, 3, generator=g), torch.randint(V, (2, 3), generator=g)
    weight = torch.tensor([[1.0, 0.5, 0.0], [0.25, 0.0, 1.0]])
    return logits, confidence, index, weight, teacher


def test_each_term_is_weighted_by_position_and_divided_by_the_trained_slots_count():
    logits, confidence, index, weight, _ = slots()
    loss, terms, ce = dspark_loss(logits, confidence, index, weight, alpha=0.5)
    q = logits.softmax(-1)
    want_ce = -q.log().gather(-1, index[..., None])[..., 0]
    torch.testing.assert_close(ce, want_ce)
    n = 4                                                           # the slots with a weight
    kl = (want_ce * weight).sum() / (n + KL_EPS)
    accept = q.gather(-1, index[..., None])[..., 0]                 # 1 - TV against a one-hot target
    conf = (F.binary_cross_entropy_with_logits(confidence, accept, reduction="none") * weight).sum() / \
        (n + CONFIDENCE_EPS)
    torch.testing.assert_close(terms["kl"], kl)
    torch.testing.assert_close(terms["confidence"], conf)
    torch.testing.assert_close(loss, kl + 0.5 * conf)
    assert not torch.isclose(terms["kl"], (want_ce * weight).sum() / weight.sum())    # DFlash's reduction differs


def test_the_teacher_term_is_the_kl_to_the_bases_distribution_and_the_confidence_its_overlap():
    logits, confidence, index, weight, teacher = slots(1)
    loss, terms, _ = dspark_loss(logits, confidence, index, weight, teacher, lm_weight=0.0, teacher_weight=1.0)
    q, p = logits.softmax(-1), teacher.softmax(-1)
    kl = (p * (p.log() - q.log())).sum(-1)
    overlap = torch.minimum(q, p).sum(-1)
    conf = F.binary_cross_entropy_with_logits(confidence, overlap, reduction="none")
    torch.testing.assert_close(terms["kl"], (kl * weight).sum() / (4 + KL_EPS))
    torch.testing.assert_close(terms["confidence"], (conf * weight).sum() / (4 + CONFIDENCE_EPS))
    torch.testing.assert_close(loss, terms["kl"] + terms["confidence"])
    with pytest.raises(ValueError, match="teacher_loss_weight > 0 needs the base's logits"):
        dspark_loss(logits, confidence, index, weight, None, teacher_weight=1.0)


def test_the_confidence_target_is_detached_and_the_head_gets_its_gradient():
    logits, confidence, index, weight, _ = slots(2)
    logits.requires_grad_(True)
    confidence.requires_grad_(True)
    _, terms, _ = dspark_loss(logits, confidence, index, weight)
    conf_only = dspark_loss(logits, confidence, index, weight, lm_weight=0.0)[0]   # the BCE term alone
    conf_only.backward()
    assert logits.grad is None or logits.grad.abs().max() == 0     # 1 - TV is a label, as the library's
    assert confidence.grad.abs().sum() > 0
