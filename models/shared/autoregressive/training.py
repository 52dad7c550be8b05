"""Training EAGLE's draft layer (EAGLE-1, EAGLE-3) or a draft model (docs/reference.md#autoregressive-drafters): the
module their methods name for their recipe kinds (models/methods/eagle/__init__.py, models/methods/draft_model/
__init__.py), with its recipe type AutoregressiveRecipe (here).

    module = AutoregressiveFitModule(heads, base_model, AutoregressiveRecipe(kind="eagle", feature_loss_weight=1.0,
                                                      teacher_loss_weight=0.1, feature_noise=0.2))

The heads are an AutoregressiveHeads (models/shared/autoregressive/heads.py): heads.draft_module is EAGLE's layer
(or a draft model's layers), the heads' LM head (the frozen base LM head over the draft vocabulary when
shared) scores its predicted features. Depth k
at position t is the draft k+1 steps after the root pair (f_t, x_{t+1}) along the true tokens (EagleModule.unroll),
and predicts the feature f_{t+k+1}, whose LM head gives token t+k+2: Medusa's head-k indexing, so the targets,
positions and validation top-k are the other families'. Per depth k < recipe.unroll:

    loss_k = feature_loss_weight * SmoothL1(pred, f_{t+k+1}) + teacher_loss_weight * softCE(LM(pred), LM(f_{t+k+1}))
             + lm_loss_weight * CE(LM(pred), x_{t+k+2})             summed with weights head_decay^k

EAGLE-1 is unroll=1 (its own inputs are always the base's features, with uniform noise whose width its trainer
scales by 512 / T for a conversation of T tokens: recipe.noise_width); unroll > 1 trains
the deeper depths on the layer's own predictions, as EAGLE-3's training-time test does. EAGLE-3 reads the base's
taps (the hidden cache holds them after the final state: base_hidden), its LM head reads module.readout(pred)
(its final norm), and its recipe has no feature loss: each depth a soft cross-entropy to the base's distribution
over the draft vocabulary, renormalised there as the authors' is. With recipe.draft_vocab_mask the positions
whose label (on distilled data the base's own greedy token) lies outside the draft vocabulary carry no loss, as
the authors drop those whose base argmax does: the draft can never propose that token. Validation measures all
num_heads depths whatever unroll is, every position counted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.shared.recipes import Recipe, check_field
from models.shared.training import HeadsModule, head_positions, soft_cross_entropy


@dataclass
class AutoregressiveRecipe(Recipe):
    """EAGLE, EAGLE-3 and a draft model: one module unrolled over its own predictions."""
    feature_loss_weight: float = 0.0    # SmoothL1 of the predicted feature to the base's
    feature_noise: float = 0.0          # width of the uniform noise on the input features while training
    noise_reference_length: int | None = None   # set: a row of T tokens gets width feature_noise * this / T
    unroll: int = 1                     # depths trained (>1: each on the draft's own predicted features)
    draft_vocab_mask: bool = False      # positions whose label lies outside the draft vocabulary carry no loss

    def __post_init__(self):
        super().__post_init__()
        k = self.kind
        check_field(k, "feature_loss_weight", self.feature_loss_weight, self.feature_loss_weight >= 0, "a number >= 0")
        check_field(k, "feature_noise", self.feature_noise, self.feature_noise >= 0, "a number >= 0")
        ref = self.noise_reference_length
        check_field(k, "noise_reference_length", ref, ref is None or (isinstance(ref, int) and not isinstance(ref, bool)
               and ref >= 1), "null (a fixed width) or a whole number >= 1 (EAGLE's trainer: 512)")
        check_field(k, "unroll", self.unroll, isinstance(self.unroll, int) and self.unroll >= 1,
               "a whole number >= 1 (the depths trained)")

    def noise_width(self, length):
        """The input-noise width of a row of `length` tokens (an int, or a tensor of one per row): feature_noise,
        times noise_reference_length / length when that is set, as EAGLE's trainer scales it (512 / T)."""
        if self.noise_reference_length is None:
            return self.feature_noise
        return self.feature_noise * self.noise_reference_length / length


class AutoregressiveFitModule(HeadsModule):
    """The frozen base's features in (from the hidden cache when the batch has them), the heads' draft module
    trained (EAGLE's layer; a draft model, distilled with the teacher loss alone)."""
    recipe_type = AutoregressiveRecipe

    def compute(self, batch) -> tuple[torch.Tensor, list, dict]:
        r, heads = self.recipe, self.heads
        module = heads.draft_module
        hidden = self.base_hidden(batch)                                                # [B, T, h (+ taps)]
        h = heads.config.hidden_size
        hidden, features = (hidden[..., :h], hidden[..., h:]) if module.taps else (hidden, hidden)
        depths = min(r.unroll, heads.config.num_heads) if self.training else heads.config.num_heads
        lengths = batch.get("lengths", features.shape[1])                             # [B] tokens a row
        noise = r.noise_width(lengths) if self.training and r.feature_noise else 0.0
        preds = module.unroll(features, batch["input_ids"], depths, noise)
        total, per_head, extra = hidden.new_zeros(()), [], {}
        for k in range(heads.config.num_heads):
            b, t, target = head_positions(batch["labels"], k, batch.get("sources"))
            if k >= len(preds) or len(t) == 0:
                per_head.append(None)
                continue
            pred, feature = preds[k][b, t], hidden[b, t + k + 1].to(preds[k].dtype)    # [N, h] each
            logits = heads.lm_head(0, heads.dropout(module.readout(pred)))             # [N, Vd]
            loss_k = logits.new_zeros(())
            if k < r.unroll:
                if r.draft_vocab_mask and self.training:       # the loss only: metrics count every position
                    keep = heads.to_draft_index(target) >= 0
                    pred, feature, scores, labels = pred[keep], feature[keep], logits[keep], target[keep]
                else:
                    scores, labels = logits, target
                if r.feature_loss_weight and len(labels):
                    feature_loss = F.smooth_l1_loss(pred.float(), feature.float())
                    loss_k = loss_k + r.feature_loss_weight * feature_loss
                    extra[f"feature_loss_head{k}"] = feature_loss.detach()
                if r.teacher_loss_weight and len(labels):
                    with torch.no_grad():
                        teacher = heads.base_draft_logits(feature)                      # [N, Vd]
                    loss_k = loss_k + r.teacher_loss_weight * soft_cross_entropy(scores, teacher)
                if r.lm_loss_weight:
                    index = heads.to_draft_index(labels)
                    inside = index >= 0
                    if inside.any():
                        loss_k = loss_k + r.lm_loss_weight * F.cross_entropy(scores[inside].float(), index[inside])
                total = total + r.head_weight(k) * loss_k
            per_head.append((loss_k.detach(), logits.detach(), target))
        return total, per_head, extra
