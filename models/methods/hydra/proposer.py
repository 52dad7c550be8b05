"""Hydra's and Hydra++'s proposer: head d sees h_t and the tokens of the path root .. node, so depth d is scored from
its frontier's paths, all nodes of a depth in one batch (Hydra++: h_t from its prefix layer, models/shared/
heads_proposer.py)."""
from __future__ import annotations

import torch

from models.engine.drafters.proposer import Frontier
from models.shared.heads_proposer import HeadsProposer


class HydraProposer(HeadsProposer):
    def scores(self, frontier: Frontier) -> torch.Tensor:
        R = frontier.nodes.numel()
        return self.head_logits(frontier.depth, self.h.expand(R, -1), frontier.paths)  # [R, Vd]
