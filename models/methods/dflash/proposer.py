"""DFlash's proposer: the whole block below the root drafted in one forward, then each depth's children read off it.

At a draft of depth D below root x_P, the module runs once over the whole block it was trained on, [x_P, mask x
(block size - 1)] at positions P.., whatever D is: the block attends to itself both ways, so a shorter block would
draft other tokens than training and calibration saw (near the length limit the authors' dflash_generate shortens
it, so there our drafts can differ from theirs, never the output). Its keys and values are the context's (the
base's tapped features of the accepted positions, cached from one draft to the next; the ones accepted since the
last draft are run with this block) and the block's own. Its first D drafting slots are read (from slot 1, or from
slot 0 with heads.sample_from_anchor): the d-th scores the token d positions below the root, so every node at depth
d - 1 gets the same children, as Medusa's heads give them: a chain takes the argmax of each position (the authors'
dflash_generate), a tree each position's top-k. After the draft the block's keys and values are cropped off, so the
cache holds the accepted positions only.
"""
from __future__ import annotations

import torch

from models.engine.drafters.base import AdvanceHistory, DraftContext
from models.engine.drafters.proposer import Frontier
from models.engine.projection import project


class DFlashProposer:
    capturable = False            # a replayed graph is not built for it yet: drafted eagerly

    def __init__(self, heads):
        self.heads, self.module = heads, heads.draft_module
        self.taps, self.max_depth = tuple(self.module.taps), heads.config.num_heads
        self.draft_ids, self.vocab_size = heads.draft_ids, heads.config.vocab_size
        self.linear = heads.output_layer(0)
        self.cache = self.module.new_cache()
        self.pending: list[tuple[torch.Tensor, int]] = []     # (features [m, w], first position) not yet cached
        self.history = AdvanceHistory()
        self.rows = self.outs = None                          # [D, Vd] and [D + 1, h] while a tree is drafted

    @property
    def device(self) -> torch.device:
        return self.module.fc.weight.device

    def start(self, ctx: DraftContext) -> None:
        """ctx.hidden [T, w]: the prompt's tapped features, positions 0..T-1."""
        self.cache, self.pending, self.rows = self.module.new_cache(), [(ctx.hidden, 0)], None
        self.history.clear()
        self.history.push(ctx.hidden.shape[0], None)

    def advance(self, hidden: torch.Tensor, tokens: list[int], position: int) -> None:
        """hidden [m, w]: the features of the accepted positions position..position+m-1."""
        if self.held() != position:
            raise ValueError(f"the DFlash drafter holds {self.held()} positions, cannot advance from {position}")
        self.pending.append((hidden, position))
        self.history.push(position + hidden.shape[0], None)

    def held(self) -> int:
        return self.cache.length + sum(h.shape[0] for h, _ in self.pending)

    def rewind(self, position: int) -> None:
        self.history.back_to(position, "the DFlash drafter")
        self.pending = [(h[:max(0, position - p)], p) for h, p in self.pending if p < position]
        self.cache.crop(min(position, self.cache.length))

    @torch.no_grad()
    def begin(self, root: int, depth: int) -> None:
        self.rows = None
        if depth == 0:
            return
        if depth > self.max_depth:
            raise ValueError(f"a DFlash block of {self.max_depth + 1} tokens drafts at most {self.max_depth} deep, "
                             f"not {depth}")
        P, Q = self.held(), self.module.block_size
        feats = torch.cat([h for h, _ in self.pending]) if self.pending else \
            torch.zeros(0, self.module.fc.in_features, device=self.device)
        first = self.cache.length
        block = torch.full((1, Q), self.module.mask_token_id, dtype=torch.long, device=self.device)
        block[0, 0] = int(root)
        pos = torch.arange(first, P + Q, device=self.device)[None]                          # context, then block
        out = self.module(feats[None].to(self.device), block, pos, cache=self.cache)[0]   # [Q, h]
        self.pending = []
        self.cache.crop(P)                                                                  # the block's rows off
        f = self.module.first_slot           # the slot drafting depth 1 (1: slot 0 is the root's alone)
        self.outs = out[:depth + f]           # [depth + f, h]: slot 0 (the root's) to the deepest drafting one
        self.rows = project(self.linear, out[f:f + depth].to(self.linear.weight.dtype))    # [depth, Vd]

    @staticmethod
    @torch.no_grad()
    def begin_many(proposers: list, roots: list[int], depth: int) -> None:
        """begin for a batch's sequences (models/engine/drafters/proposer.py draft_trees) in one forward: each row its
        cached context (right-padded to the longest), its new context rows (padded likewise) and its block at its
        own positions, the padding hidden; then each sequence's new context rows go into its own cache, as begin
        leaves them."""
        if depth == 0 or len(proposers) == 1:
            for p, root in zip(proposers, roots):
                p.begin(root, depth)
            return
        first = proposers[0]
        if depth > first.max_depth:
            raise ValueError(f"a DFlash block of {first.max_depth + 1} tokens drafts at most {first.max_depth} deep, "
                             f"not {depth}")
        module, device, B, Q = first.module, first.device, len(proposers), first.module.block_size
        feats = [torch.cat([h for h, _ in p.pending]) if p.pending else
                 torch.zeros(0, module.fc.in_features, device=device) for p in proposers]
        cached, new = [p.cache.length for p in proposers], [f.shape[0] for f in feats]
        S, M = max(cached), max(new)
        ctx = torch.zeros(B, M, module.fc.in_features, device=device)
        block = torch.full((B, Q), module.mask_token_id, dtype=torch.long, device=device)
        pos = torch.zeros(B, M + Q, dtype=torch.long, device=device)
        visible = torch.zeros(B, 1, Q, S + M + Q, dtype=torch.bool, device=device)
        for b, (p, f, root) in enumerate(zip(proposers, feats, roots)):
            ctx[b, :new[b]] = f.to(device)
            block[b, 0] = int(root)
            pos[b, :new[b]] = torch.arange(cached[b], cached[b] + new[b], device=device)
            pos[b, M:] = torch.arange(cached[b] + new[b], cached[b] + new[b] + Q, device=device)
            visible[b, ..., :cached[b]] = True
            visible[b, ..., S:S + new[b]] = True
        visible[..., S + M:] = True                                          # the block sees itself both ways
        cache = module.new_cache()
        for i in range(len(module.layers)):
            if S:
                k0 = next(p.cache.k[i] for p in proposers if p.cache.k[i] is not None)
                shape = (B, k0.shape[1], S, k0.shape[-1])
                k, v = k0.new_zeros(shape), k0.new_zeros(shape)
                for b, p in enumerate(proposers):
                    if cached[b]:
                        k[b, :, :cached[b]], v[b, :, :cached[b]] = p.cache.k[i][0], p.cache.v[i][0]
                cache.k[i], cache.v[i] = k, v
        out = module(ctx, block, pos, cache=cache, mask=visible)                        # [B, Q, h]
        f = module.first_slot
        rows = project(first.linear, out[:, f:f + depth].reshape(B * depth, -1).to(first.linear.weight.dtype))
        for b, p in enumerate(proposers):
            for i in range(len(module.layers)):                  # its new context rows into its own cache
                p.cache.extend(i, cache.k[i][b:b + 1, :, S:S + new[b]], cache.v[i][b:b + 1, :, S:S + new[b]])
            p.pending, p.rows, p.outs = [], rows[b * depth:(b + 1) * depth], out[b, :depth + f]

    def scores(self, frontier: Frontier) -> torch.Tensor:
        return self.rows[frontier.depth:frontier.depth + 1]                                 # [1, Vd]

    def end(self) -> None:
        self.rows = self.outs = None
