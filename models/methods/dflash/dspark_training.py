"""DSpark's training: DFlash's block recipe (models/methods/dflash/training.py: anchors, masked blocks, the
position-weighted cross-entropy) on logits that carry the Markov bias of the true token before each position, plus
the confidence head's term: binary cross-entropy of its logit against the draft's probability of the target token
(with the distilled token as the target's distribution, one-hot, that is 1 - the total-variation distance the
library trains against), over the same positions with the same position weights, divided by their count (as the
library's), times confidence_alpha (its 1.0). The cross-entropy stands for the library's default KL term, which is
the same for a one-hot target. Not the library's: the Markov head's W2 starts at zero (a fresh head drafts as DFlash),
and the rnn's state starts at block position 1, where the library's (sample_from_anchor off) runs from the anchor's.

    module = DSparkFitModule(heads, base_model, DSparkRecipe(kind="dspark", num_anchors=32, confidence_alpha=1.0))
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.methods.dflash.training import DFlashFitModule, DFlashRecipe
from models.shared.recipes import check_field


@dataclass
class DSparkRecipe(DFlashRecipe):
    confidence_alpha: float = 1.0       # the confidence head's BCE weight (0: it is not trained)

    def __post_init__(self):
        super().__post_init__()
        a = self.confidence_alpha
        check_field(self.kind, "confidence_alpha", a, isinstance(a, (int, float)) and a >= 0, "a number >= 0")


class DSparkFitModule(DFlashFitModule):
    recipe_type = DSparkRecipe

    def block_logits(self, out, prev, index, weight):
        """Position 0 (the anchor, weight 0) by the LM head alone; positions 1.. with the Markov bias of the token
        before each; the confidence term over the positions with a weight."""
        heads = self.heads
        logits = torch.cat([heads.lm_head(0, out[..., :1, :]), heads.block_logits(out[..., 1:, :], prev[..., 1:])], -2)
        if not self.recipe.confidence_alpha:
            return logits, None
        w = weight[..., 1:]
        if not (w > 0).any():
            return logits, logits.new_zeros(())
        with torch.no_grad():                 # the draft's probability of the target: its acceptance's soft label
            p = torch.softmax(logits[..., 1:, :].float(), -1).gather(-1, index[..., 1:, None].clamp(min=0))[..., 0]
        conf = heads.accept_logits(out[..., 1:, :], prev[..., 1:])
        bce = F.binary_cross_entropy_with_logits(conf.float(), p, reduction="none")
        return logits, self.recipe.confidence_alpha * (bce * w).sum() / (w > 0).sum()
