"""One step's growth of EAGLE-2's tree (the algorithm: grown.py's docstring): Grown, everything a step drafted, and
grow, which drafts it through a proposer, pruned (the host growth of GrownTreeDrafter) or not (reading nothing back:
the fixed-shape growth that graphed_growth.py replays as a CUDA graph).
"""
from __future__ import annotations

import torch

from models.engine.drafters.proposer import Frontier, Proposer, proposer_device, select_children, to_token_ids
from models.engine.trees import GrownTree


def drafted_before(level: int, top_k: int) -> int:
    """Nodes an unpruned growth has drafted before `level` (the root, top_k, then top_k x top_k a level)."""
    return 1 if level == 0 else 1 + top_k + (level - 1) * top_k * top_k


def frontier_rows(levels: int, top_k: int) -> int:
    """Rows an unpruned growth of `levels` levels runs through the proposer (what it makes room for)."""
    return 1 + max(levels - 1, 0) * top_k


class Grown:
    """Everything one step drafted, in drafting order (node 0 the root; a parent before its children): M nodes, every
    tensor on the proposer's device (root: a token id, or a one-element tensor there)."""

    def __init__(self, capacity: int, levels: int, root: int | torch.Tensor, device: torch.device):
        self.n = 1
        self.tokens = torch.empty(capacity, dtype=torch.long, device=device)
        self.tokens[:1] = root
        self.parent = torch.full((capacity,), -1, dtype=torch.long, device=device)
        self.rank = torch.zeros(capacity, dtype=torch.long, device=device)   # column among its parent's top_k
        self.score = torch.zeros(capacity, device=device)                     # cumulative log-probability, root 0
        self.ancestors = torch.zeros(capacity, capacity, dtype=torch.bool, device=device)
        self.ancestors[0, 0] = True
        self.path = torch.zeros(capacity, levels + 1, dtype=torch.long, device=device)   # root .. node, 0-padded

    def frontier(self, d: int, nodes: torch.Tensor) -> Frontier:
        n = self.n
        return Frontier(d, nodes, self.parent[nodes], self.tokens[self.path[nodes, :d + 1]],
                        self.ancestors[nodes, :n], self.tokens[:n])

    def add_children(self, d: int, nodes: torch.Tensor, picks: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        """picks, logp [R, k]: the children of frontier `nodes` [R] at depth d + 1 -> their node indices [R * k]."""
        R, k = picks.shape
        device = self.tokens.device
        new = torch.arange(self.n, self.n + R * k, device=device)
        par = nodes.repeat_interleave(k)
        self.tokens[new] = picks.reshape(-1).to(device)
        self.parent[new], self.rank[new] = par, torch.arange(k, device=device).repeat(R)
        # log-softmax of a top value is <= 0 up to rounding: clamped, so a child never outscores its parent
        self.score[new] = self.score[par] + logp.reshape(-1).float().clamp(max=0.0)
        self.ancestors[new] = self.ancestors[par]
        self.ancestors[new, new] = True
        self.path[new] = self.path[par]
        self.path[new, d + 1] = new
        self.n += R * k
        return new

    def threshold(self, nodes: int) -> float:
        """The (nodes + 1)-th best score drafted so far (the root counts); -inf while fewer nodes are drafted. A node
        scoring at or below it cannot have a kept descendant."""
        if self.n <= nodes:
            return float("-inf")
        return float(torch.topk(self.score[:self.n], nodes + 1).values[-1])

    def best_indices(self, nodes: int) -> torch.Tensor:
        """The root and the `nodes` best-scoring drafts, in drafting order, computed on the device (ties: the
        earlier node first, so every kept node's parent is kept)."""
        order = torch.sort(self.score[:self.n], descending=True, stable=True).indices
        return order[:nodes + 1].sort().values

    def best(self, nodes: int) -> torch.Tensor:
        """best_indices, checked on the host: every kept node's parent kept."""
        keep = self.best_indices(nodes)
        kept = torch.zeros(self.n, dtype=torch.bool, device=keep.device)
        kept[keep] = True
        if not kept[self.parent[keep[1:]]].all():
            raise RuntimeError("the grown tree's best nodes miss an ancestor: a child outscored its parent")
        return keep


def grow(proposer: Proposer, root: int | torch.Tensor, tree: GrownTree, levels: int, sampling, generator=None,
         prune: bool = True) -> Grown:
    """Draft the candidates of one step (steps 1 and 2 of the module docstring), at most `levels` levels deep;
    prune: skip the frontier nodes no kept node can descend from (the module docstring), the kept tree unchanged."""
    k, device = tree.top_k, proposer_device(proposer)
    grown = Grown(drafted_before(levels, k), levels, root, device)
    frontier = torch.zeros(1, dtype=torch.long, device=device)
    proposer.begin(root, levels)
    try:
        for d in range(levels):
            logits = proposer.scores(grown.frontier(d, frontier))                      # [R or 1, Vd]
            kids = select_children(logits, k, sampling, generator, want_logp=True)
            R = frontier.numel()
            picks, logp = kids.picks.expand(R, -1), kids.logp.expand(R, -1)            # Medusa: one row for all
            new = grown.add_children(d, frontier, to_token_ids(proposer, picks), logp)
            frontier = new[torch.sort(grown.score[new], descending=True, stable=True).indices[:k]]
            if prune:
                frontier = frontier[grown.score[frontier] > grown.threshold(tree.nodes)]
                if frontier.numel() == 0:
                    break
    finally:
        proposer.end()
    return grown
