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
        self._all = None                                # [depth, Vd]: every head on h_t, while a tree is drafted

    def begin(self, root: int, depth: int) -> None:
        if depth == 0:
            return
        if self.linears is not None and self.heads.lm_heads is None:   # shared LM head: one product
            x = torch.stack([self.heads.head_hidden(k, self.h) for k in range(depth)])
            self._all = project(self.linears[0], x)
        else:
            self._all = torch.cat([self.head_logits(k, self.h[None]) for k in range(depth)])

    def scores(self, frontier: Frontier) -> torch.Tensor:
        return self._all[frontier.depth:frontier.depth + 1]                       # [1, Vd]

    def end(self) -> None:
        self._all = None
