"""Medusa's proposer: head k sees h_t only, so every node of a depth gets the same children. All heads run once per
tree on h_t (one LM-head product when the heads share the base LM head), and scores returns one row per depth."""
from __future__ import annotations

import torch

from models.engine.drafters.proposer import Frontier
from models.engine.projection import project
from models.shared.heads_proposer import HeadsProposer


class MedusaProposer(HeadsProposer):
    def __init__(self, heads):
        super().__init__(heads)
        self.all_depths = None                                # [depth, Vd]: every head on h_t, while a tree is drafted

    def begin(self, root: int, depth: int) -> None:
        self.begin_many([self], [root], depth)

    def scores(self, frontier: Frontier) -> torch.Tensor:
        return self.all_depths[frontier.depth:frontier.depth + 1]                  # [1, Vd]

    @staticmethod
    def begin_many(proposers: list, roots: list[int], depth: int) -> None:
        """Every sequence's heads on its own h_t, one product a head (one LM-head product in all when the heads
        share the base LM head): a tree's begin, or a batch's (models/engine/drafters/proposer.py draft_trees);
        proposers of different heads begin one by one."""
        first = proposers[0]
        if depth == 0:
            return
        if any(p.heads is not first.heads for p in proposers):
            for p, root in zip(proposers, roots):
                MedusaProposer.begin_many([p], [root], depth)
            return
        H, B = torch.stack([p.h for p in proposers]), len(proposers)                 # [B, h]
        if first.linears is not None and first.heads.lm_heads is None:
            x = torch.stack([first.heads.head_hidden(k, H) for k in range(depth)], 1)  # [B, depth, h]
            rows = project(first.linears[0], x.reshape(B * depth, -1)).view(B, depth, -1)
        else:
            rows = torch.stack([first.head_logits(k, H) for k in range(depth)], 1)    # [B, depth, Vd]
        for p, mine in zip(proposers, rows):
            p.all_depths = mine

    def end(self) -> None:
        self.all_depths = None
