"""DFlash's training (the authors' recipe as SpecForge trains it, docs/reference.md): for each conversation, anchors
are drawn among its assistant positions; each anchor's block is its token followed by mask tokens at the next
positions, and all the blocks of a conversation run in one forward. A block sees the base's features of the positions
strictly before its anchor (what decoding has as context: the anchor is the root, whose own features come with its
verify step) and itself, both ways; no other block. Position k of a block is trained to the token k after its anchor,
by cross-entropy weighted exp(-(k - 1) / loss_decay_gamma) (an assistant token only; k = 0, the anchor, not at all),
the weighted mean over every block.

    module = DFlashFitModule(heads, base_model, DFlashRecipe(kind="dflash", num_anchors=32, loss_decay_gamma=7.0))
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.methods.dflash.dflash import BlockLayout
from models.shared.recipes import Recipe, check_field
from models.shared.training import IGNORE_INDEX, HeadsModule


@dataclass
class DFlashRecipe(Recipe):
    """The block recipe's own fields."""
    num_anchors: int = 512              # blocks drawn per conversation (at most its assistant positions)
    loss_decay_gamma: float | None = 7.0   # position k weighted exp(-(k - 1) / gamma); None: every position alike

    def __post_init__(self):
        super().__post_init__()
        k = self.kind
        check_field(k, "num_anchors", self.num_anchors, isinstance(self.num_anchors, int) and self.num_anchors >= 1,
                    "a whole number >= 1")
        g = self.loss_decay_gamma
        check_field(k, "loss_decay_gamma", g, g is None or g > 0, "null or a positive number")


def draw_anchors(valid: torch.Tensor, n: int, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """valid [B, T] bool (where a block may start) -> (anchors [B, N], keep [B, N]): up to n distinct positions per
    row, drawn uniformly, in order; a row with fewer valid positions pads with position 0, kept False."""
    B, T = valid.shape
    N = max(1, min(n, int(valid.sum(1).max())))
    keys = torch.rand(B, T, generator=generator, device=valid.device).masked_fill(~valid, 2.0)
    order = keys.argsort(dim=1)[:, :N]
    keep = torch.gather(valid, 1, order)
    anchors, index = order.masked_fill(~keep, T).sort(dim=1)          # the kept ones first, in order
    keep = torch.gather(keep, 1, index)
    return anchors.masked_fill(~keep, 0), keep


class DFlashFitModule(HeadsModule):
    """The frozen base's tapped features in (from the hidden cache when the batch has them), the draft trained."""
    recipe_type = DFlashRecipe

    def compute(self, batch):
        heads, module, r = self.heads, self.heads.draft_module, self.recipe
        ids, labels = batch["input_ids"], batch["labels"]
        B, T = ids.shape
        bs, h = module.block_size, self.heads.config.hidden_size
        feats = self.base_hidden(batch)[..., h:]                                            # [B, T, taps * h]
        loss_mask = labels != IGNORE_INDEX                                                  # assistant tokens
        valid = loss_mask.clone()
        valid[:, max(T - bs + 1, 0):] = False                                               # a whole block fits
        anchors, keep = draw_anchors(valid, r.num_anchors)
        N = anchors.shape[1]
        offsets = torch.arange(bs, device=ids.device)
        at = anchors[..., None] + offsets                                                   # [B, N, bs]
        block_ids = torch.full((B, N, bs), module.mask_token_id, dtype=torch.long, device=ids.device)
        block_ids[..., 0] = torch.where(keep, ids.gather(1, anchors), block_ids[..., 0])
        pos = torch.cat([torch.arange(T, device=ids.device).expand(B, T), at.view(B, -1)], dim=1)
        layout = BlockLayout(anchors, keep, T, bs)               # block_mask's attention, without its dense scores
        out = module(feats, block_ids.view(B, -1), pos, mask=layout).view(B, N, bs, -1)   # [B, N, bs, h]
        target = ids.gather(1, at.clamp(max=T - 1).view(B, -1)).view(B, N, bs)
        weight = (keep[..., None] & (at < T) &
                  loss_mask.gather(1, at.clamp(max=T - 1).view(B, -1)).view(B, N, bs)).float()
        weight = weight * torch.tensor(position_weights(bs, r.loss_decay_gamma), device=ids.device)
        index = heads.to_draft_index(target)
        weight = weight * (index >= 0)                                  # a token outside the draft vocabulary
        prev = torch.cat([block_ids[..., :1], target[..., :-1]], -1)   # the true token before each position (k >= 1)
        logits, extra = self.block_logits(out, prev, index, weight)                         # [B, N, bs, Vd]
        ce = F.cross_entropy(logits.flatten(0, 2).float(), index.clamp(min=0).flatten(), reduction="none")
        loss = (ce * weight.flatten()).sum() / weight.sum().clamp(min=1e-6)
        loss = loss if extra is None else loss + extra
        per_head = []
        for k in range(1, bs):                                           # "head" k - 1: the token k after the anchor
            sel = weight[..., k] > 0
            if not sel.any():
                per_head.append(None)
                continue
            loss_k = (ce.view(B, N, bs)[..., k][sel]).mean()
            per_head.append((loss_k.detach(), logits[..., k, :][sel].detach(), target[..., k][sel]))
        return loss, per_head, {"blocks": keep.sum().float(), **({"extra_loss": extra.detach()} if extra is not None
                                                                  else {})}

    def block_logits(self, out, prev, index, weight) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The blocks' logits [B, N, bs, Vd] and a loss term of the method's own beside the cross-entropy (None):
        DFlash's, the LM head alone (DSpark adds its heads: dspark_training.py)."""
        return self.heads.lm_head(0, out), None


def position_weights(block: int, gamma: float | None) -> list[float]:
    """The loss weight of each block position: 0 for the anchor, exp(-(k - 1) / gamma) for position k (1 without a
    gamma)."""
    return [0.0] + [math.exp(-(k - 1) / gamma) if gamma else 1.0 for k in range(1, block)]
