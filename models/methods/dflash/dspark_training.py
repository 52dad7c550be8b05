"""DSpark's training: DFlash's blocks (models/methods/dflash/training.py draw_blocks) on logits that carry the Markov
bias of the true token before each slot, and the speculators library's loss on them (speculators 0.9.0,
models/dspark/metrics.py compute_metrics, losses/utils.py loss_function; read for facts), term for term (dspark_loss):

    KL    = sum_slots w * (lm_loss_weight * KL(one-hot of the distilled token || q)
                           + teacher_loss_weight * KL(p_base || q)) / (n + 1e-5)
    conf  = sum_slots w * BCE(confidence logit, 1 - TV(q, p)) / (n + 1e-8)        (1 - TV detached)
    loss  = KL + confidence_alpha * conf

q the draft's (biased) distribution, p the target's: the one-hot token, or with teacher_loss_weight the base's own
distribution at the position before the target (the library's verifier targets; for a one-hot p, 1 - TV is q's
probability of the token and the KL is the cross-entropy); w the slot's position weight (exp(-k / gamma) from slot 0
with sample_from_anchor, exp(-(k - 1) / gamma) from slot 1 without), n the count of trained slots (the library's
loss-mask sum), eps the library's. Its default is the KL against the verifier's distribution; ours stays on the
one-hot target every method here trains on (lm 1.0, teacher 0.0), the library's term with that target.

A slot whose distilled token is outside the draft vocabulary has no one-hot target: the lm term skips it, the teacher
term (a distribution over the draft vocabulary) keeps it, as the library keeps every slot of its mask. The departure
that remains (docs/protocol.md): with sample_from_anchor the library masks the target at a + k + 1 by the loss mask
of the input position a + k, ours by the target's own (its assistant label).

    module = DSparkFitModule(heads, base_model, DSparkRecipe(kind="dspark", num_anchors=32, confidence_alpha=1.0))
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.methods.dflash.training import DFlashFitModule, DFlashRecipe
from models.shared.recipes import check_field

KL_EPS = 1e-5                   # the library's _LOSS_REDUCTION_EPS (losses/utils.py)
CONFIDENCE_EPS = 1e-8           # its _EPS (models/dspark/metrics.py)


@dataclass
class DSparkRecipe(DFlashRecipe):
    confidence_alpha: float = 1.0       # the confidence head's BCE weight (0: it is not trained)

    def __post_init__(self):
        super().__post_init__()
        a = self.confidence_alpha
        check_field(self.kind, "confidence_alpha", a, isinstance(a, (int, float)) and a >= 0, "a number >= 0")


def dspark_loss(logits: torch.Tensor, confidence: torch.Tensor | None, index: torch.Tensor, weight: torch.Tensor,
                teacher: torch.Tensor | None = None, lm_weight: float = 1.0, teacher_weight: float = 0.0,
                alpha: float = 1.0) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """The library's DSpark loss (module docstring) over slots [...]: logits [..., Vd] (biased), confidence [...]
    logits or None, index [...] the distilled token's draft index (-1 outside: no lm term there), weight [...] the
    position weight of each trained slot (0: not trained), teacher [..., Vd] the base's logits (with teacher_weight)
    -> (loss, its terms {"kl", "confidence"} detached, each slot's cross-entropy [...] detached)."""
    if teacher_weight and teacher is None:
        raise ValueError("teacher_loss_weight > 0 needs the base's logits (teacher)")
    n = (weight > 0).sum()
    logq = torch.log_softmax(logits.float(), -1)
    ce = -logq.gather(-1, index.clamp(min=0)[..., None])[..., 0]                  # KL of the one-hot target
    p = None if not teacher_weight else torch.softmax(teacher.float(), -1)
    if p is None and (weight[index < 0] > 0).any():
        raise ValueError("a slot trained on its one-hot token alone needs the token in the draft vocabulary")
    kl = lm_weight * ce * (index >= 0) if lm_weight else torch.zeros_like(ce)
    if p is not None:
        kl = kl + teacher_weight * F.kl_div(logq, p, reduction="none").sum(-1)
    loss = (kl * weight).sum() / (n + KL_EPS)
    terms = {"kl": loss.detach()}
    if confidence is not None and alpha:
        with torch.no_grad():                  # 1 - TV(q, p): the draft's acceptance under its target
            accept = torch.minimum(logq.exp(), p).sum(-1) if p is not None else (-ce).exp()
        bce = F.binary_cross_entropy_with_logits(confidence.float(), accept, reduction="none")
        conf = (bce * weight).sum() / (n + CONFIDENCE_EPS)
        terms["confidence"] = conf.detach()
        loss = loss + alpha * conf
    return loss, terms, ce.detach()


class DSparkFitModule(DFlashFitModule):
    recipe_type = DSparkRecipe

    def block_loss(self, out, blocks, index, weight, final):
        """Every slot with the Markov bias of the token before its target (blocks.prev: slot 0's is the anchor, so
        the rnn's state runs from the anchor's slot); dspark_loss on them."""
        heads, r = self.heads, self.recipe
        logits = heads.block_logits(out, blocks.prev)
        confidence = heads.accept_logits(out, blocks.prev) if r.confidence_alpha else None
        teacher = None
        if r.teacher_loss_weight:               # the base's logits at the position before each target
            B, N, bs = blocks.at.shape
            before = (blocks.at - 1).clamp(min=0, max=final.shape[1] - 1).view(B, -1)
            with torch.no_grad():
                rows = final.gather(1, before[..., None].expand(-1, -1, final.shape[-1]))
                teacher = heads.base_draft_logits(rows).view(B, N, bs, -1)
            weight = blocks.weight          # the teacher's slots: every one, its token in the vocabulary or not
        loss, terms, ce = dspark_loss(logits, confidence, index, weight, teacher, r.lm_loss_weight,
                                      r.teacher_loss_weight, r.confidence_alpha)
        return loss, logits, ce, {f"{k}_loss": v for k, v in terms.items()}
