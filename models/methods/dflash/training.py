"""DFlash's training (the authors' recipe as SpecForge trains it, docs/reference.md): for each conversation, anchors
are drawn among its assistant positions; each anchor's block is its token followed by mask tokens at the next
positions, and all the blocks of a conversation run in one forward. A block sees the base's features of the positions
strictly before its anchor (what decoding has as context: the anchor is the root, whose own features come with its
verify step) and itself, both ways; no other block. Position k of a block is trained to the token k after its anchor,
by cross-entropy weighted exp(-(k - 1) / loss_decay_gamma) (an assistant token only; k = 0, the anchor, not at all),
the weighted mean over every block. With heads.sample_from_anchor (DSpark's default, the speculators library's) slot
k is trained to the token k + 1 after the anchor, weighted exp(-k / gamma) from slot 0 on.

draw_blocks draws the blocks (Blocks) and block_loss is the method's loss on them (DSpark's: dspark_training.py).

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


@dataclass(frozen=True)
class Blocks:
    """A batch's drawn blocks: anchors and keep [B, N] (draw_anchors), and per block slot [B, N, bs]: ids (the anchor,
    then masks), at (the position of the token the slot drafts), target (that token), prev (the token before it:
    the slot's Markov input), weight (its position weight where it is trained: a kept block, an assistant target
    inside the sequence; 0 elsewhere); pos [B, T + N * bs] the context's positions then the slots'; layout the
    blocks' attention (block_attention)."""
    anchors: torch.Tensor
    keep: torch.Tensor
    ids: torch.Tensor
    at: torch.Tensor
    target: torch.Tensor
    prev: torch.Tensor
    weight: torch.Tensor
    pos: torch.Tensor
    layout: BlockLayout


def draw_blocks(ids: torch.Tensor, loss_mask: torch.Tensor, module, num_anchors: int, gamma: float | None,
                anchors: tuple[torch.Tensor, torch.Tensor] | None = None) -> Blocks:
    """The blocks of a batch (ids, loss_mask [B, T]) for `module` (its block size, mask token and first_slot):
    up to num_anchors anchors drawn among the assistant positions where a whole block fits (or `anchors`, an
    (anchors, keep) pair, as given); slot k drafts the token at anchor + k + 1 - first_slot."""
    B, T = ids.shape
    bs, f = module.block_size, module.first_slot
    if anchors is None:
        valid = loss_mask.clone()
        valid[:, max(T - bs + f, 0):] = False                          # the block's last target fits
        anchors = draw_anchors(valid, num_anchors)
    starts, keep = anchors
    N = starts.shape[1]
    slots = torch.arange(bs, device=ids.device)
    at = starts[..., None] + slots + (1 - f)                                            # [B, N, bs]
    inside = at < T
    gather = lambda where: ids.gather(1, where.clamp(max=T - 1).view(B, -1)).view(B, N, bs)   # noqa: E731
    block_ids = torch.full((B, N, bs), module.mask_token_id, dtype=torch.long, device=ids.device)
    block_ids[..., 0] = torch.where(keep, ids.gather(1, starts), block_ids[..., 0])
    pos = torch.cat([torch.arange(T, device=ids.device).expand(B, T), (starts[..., None] + slots).view(B, -1)], 1)
    trained = keep[..., None] & inside & loss_mask.gather(1, at.clamp(max=T - 1).view(B, -1)).view(B, N, bs)
    weight = trained.float() * torch.tensor(position_weights(bs, gamma, f), device=ids.device)
    prev = gather(torch.maximum(at - 1, starts[..., None]))        # the token before the target (slot 0: the anchor)
    return Blocks(starts, keep, block_ids, at, gather(at), prev, weight, pos, BlockLayout(starts, keep, T, bs))


class DFlashFitModule(HeadsModule):
    """The frozen base's tapped features in (from the hidden cache when the batch has them), the draft trained."""
    recipe_type = DFlashRecipe

    def compute(self, batch):
        heads, module, r = self.heads, self.heads.draft_module, self.recipe
        ids, labels = batch["input_ids"], batch["labels"]
        B, T = ids.shape
        bs, f, h = module.block_size, module.first_slot, self.heads.config.hidden_size
        both = self.base_hidden(batch)                                    # [B, T, h (final) + taps * h]
        blocks = draw_blocks(ids, labels != IGNORE_INDEX, module, r.num_anchors, r.loss_decay_gamma)
        N = blocks.anchors.shape[1]
        out = module(both[..., h:], blocks.ids.view(B, -1), blocks.pos, mask=blocks.layout).view(B, N, bs, -1)
        index = heads.to_draft_index(blocks.target)
        weight = blocks.weight * (index >= 0)                             # a token outside the draft vocabulary
        loss, logits, ce, extra = self.block_loss(out, blocks, index, weight, both[..., :h])
        per_head = []
        for k in range(f, bs):                                 # "head" k - f: the token k + 1 - f after the anchor
            sel = weight[..., k] > 0
            if not sel.any():
                per_head.append(None)
                continue
            per_head.append((ce[..., k][sel].mean(), logits[..., k, :][sel].detach(), blocks.target[..., k][sel]))
        return loss, per_head, {"blocks": blocks.keep.sum().float(), **extra}

    def block_loss(self, out, blocks: Blocks, index, weight, final) -> tuple[torch.Tensor, torch.Tensor,
                                                                             torch.Tensor, dict]:
        """(loss, the blocks' logits [B, N, bs, Vd], each slot's cross-entropy [B, N, bs] detached, extra figures to
        log): DFlash's, the LM head's cross-entropy weighted by position, over the sum of the weights."""
        logits = self.heads.lm_head(0, out)
        ce = F.cross_entropy(logits.flatten(0, 2).float(), index.clamp(min=0).flatten(), reduction="none")
        ce = ce.view(weight.shape)
        return (ce * weight).sum() / weight.sum().clamp(min=1e-6), logits, ce.detach(), {}


def position_weights(block: int, gamma: float | None, first_slot: int = 1) -> list[float]:
    """The loss weight of each block slot k: exp(-(k - first_slot) / gamma) from the first drafting slot on (1
    without a gamma), 0 for the anchor's slot when it drafts nothing (first_slot 1), as the library's
    dflash_loss_decay."""
    return [0.0] * first_slot + [math.exp(-(k - first_slot) / gamma) if gamma else 1.0
                                 for k in range(first_slot, block)]
