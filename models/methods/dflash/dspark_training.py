"""DSpark's training: DFlash's block recipe (models/methods/dflash/training.py: anchors, masked blocks, the
position-weighted cross-entropy) on logits that carry the Markov bias of the true token before each position, plus
the confidence head's term: binary cross-entropy of its logit against the draft's probability of the target token
(with the distilled token as the target's distribution, one-hot, that is 1 - the total-variation distance the
library trains against), over the same positions with the same position weights, divided by their count (as the
library's), times confidence_alpha (its 1.0). The cross-entropy stands for the library's default KL term, which is
the same for a one-hot target. As the library's with sample_from_anchor off: every slot of the block gets the bias
of the token before it (slot 0, the anchor, its own token's: [b0, b0, b1, ...]), so the rnn's state runs from the
anchor's slot; slot 0 itself is never trained (weight 0).

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
        """Every slot with the Markov bias of the token before it (the anchor's slot, weight 0, too: the rnn's
        state starts there); the confidence term over the positions with a weight."""
        heads = self.heads
        logits = heads.block_logits(out, prev)
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
