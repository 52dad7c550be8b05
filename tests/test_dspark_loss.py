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


def test_a_token_outside_the_draft_vocabulary_keeps_its_teacher_term_and_drops_its_lm_term():
    """As the library keeps every slot of its mask: with the teacher's distribution the slot counts and is trained
    on it; the one-hot term has no target there, so it skips it; with one-hot targets alone it may not be given."""
    logits, confidence, index, weight, teacher = slots(3)
    index[0, 0] = -1                                                # its distilled token outside the vocabulary
    _, both, _ = dspark_loss(logits, confidence, index, weight, teacher, lm_weight=1.0, teacher_weight=1.0)
    _, soft, _ = dspark_loss(logits, confidence, index, weight, teacher, lm_weight=0.0, teacher_weight=1.0)
    ce = -logits.log_softmax(-1).gather(-1, index.clamp(min=0)[..., None])[..., 0]
    lm = (ce * weight * (index >= 0)).sum() / (4 + KL_EPS)          # 4 slots counted, the outside one among them
    torch.testing.assert_close(both["kl"], soft["kl"] + lm)
    with pytest.raises(ValueError, match="one-hot token alone needs the token in the draft vocabulary"):
        dspark_loss(logits, confidence, index, weight)


def test_the_confidence_target_is_detached_and_the_head_gets_its_gradient():
    logits, confidence, index, weight, _ = slots(2)
    logits.requires_grad_(True)
    confidence.requires_grad_(True)
    _, terms, _ = dspark_loss(logits, confidence, index, weight)
    conf_only = dspark_loss(logits, confidence, index, weight, lm_weight=0.0)[0]   # the BCE term alone
    conf_only.backward()
    assert logits.grad is None or logits.grad.abs().max() == 0     # 1 - TV is a label, as the library's
    assert confidence.grad.abs().sum() > 0


def replays_the_librarys_loss(kind: str) -> float:
    """The largest difference between our DSpark training loss (pipelines/dflash_check.py our_dspark_loss: the
    training module's block_loss on the library's anchors) and the library's own, recorded in
    tests/golden/speculators_dspark.json by make dflash-check, over both targets (teacher, one_hot) and both figures
    (total, confidence)."""
    import json

    from models.methods.dflash.seeded import seeded
    from pipelines.dflash_check import DSPARK_GOLDEN, loss_difference, our_dspark_loss

    g = json.loads(DSPARK_GOLDEN.read_text())
    theirs = g["kinds"][kind]
    model, heads = seeded(g["seed"], g["layers"], g["block"], family=theirs["family"],
                          sample_from_anchor=theirs["sample_from_anchor"])
    ours = our_dspark_loss(model, heads, torch.tensor(g["prompt"])[None], theirs["anchors"], theirs["gamma"],
                           theirs["confidence_alpha"])
    return loss_difference(ours, theirs["loss"])


@pytest.mark.parametrize("kind", ["dspark", "dspark_gated", "dspark_rnn", "dspark_rnn_from_anchor"])
def test_our_loss_is_the_librarys_on_the_golden_drafters_and_not_with_dflashs_reduction(kind, monkeypatch):
    """Within 1e-6 of the library's loss on each seeded kind; divided by the weights' sum instead of the count (main's
    reduction before), it is not."""
    import models.methods.dflash.dspark_training as training

    assert replays_the_librarys_loss(kind) <= 1e-6
    real = training.dspark_loss

    def by_the_weights_sum(logits, confidence, index, weight, *args, **kwargs):
        return real(logits, confidence, index, weight * (weight > 0).sum() / weight.sum(), *args, **kwargs)
    monkeypatch.setattr(training, "dspark_loss", by_the_weights_sum)
    assert replays_the_librarys_loss(kind) > 1e-3
