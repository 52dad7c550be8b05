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

    @staticmethod
    def scores_many(proposers: list, frontiers: list[Frontier]) -> list[torch.Tensor]:
        """A batch's frontiers of one depth in one call of the head (each node with its own sequence's h_t and path):
        -> each sequence's [R, Vd]; proposers of other heads score alone."""
        first = proposers[0]
        if any(p.heads is not first.heads for p in proposers):
            return [p.scores(f) for p, f in zip(proposers, frontiers)]
        sizes = [f.nodes.numel() for f in frontiers]
        hidden = torch.cat([p.h.expand(n, -1) for p, n in zip(proposers, sizes)])          # [sum R, h]
        paths = torch.cat([f.paths for f in frontiers])                                    # [sum R, d + 1]
        return list(first.head_logits(frontiers[0].depth, hidden, paths).split(sizes))
