"""EAGLE-2's grown tree at fixed shapes, computed on the device and replayed as one CUDA graph.

    growth = GraphedGrowth(proposer, tree, levels, capture=True)     # kept by the GrownTreeDrafter across decodes
    grown = growth.draft(root)        # a DeviceTree: tokens, ancestors, depths, parents of the kept nodes, on device

The eager growth (grown.py) is host-bound on a GPU: it reads every level's scores back to rank them, prunes, and
builds the kept tree's buffers in Python (EAGLE's draft took 13.4 ms of wall time for 2.3 ms of kernels on an
H200). Its shapes are fixed level by level, as SGLang's EAGLE worker relies on: level 0 gives the root top_k
children, every later level gives the top_k best of the previous level's children top_k children each. So here
the unpruned growth runs with every index computed on the device: the scores (cumulative log-probabilities), the
frontier (a stable sort of the level's scores, ties to the earlier node, as grown.py), the final `nodes` best
(stable too), and the kept tree's ancestor mask, depths and parents. Nothing is read back, so the whole walk is one
graph, captured on first use and replayed after; off CUDA the same walk runs eagerly from the same buffers. The
kept tree is grown.py's (pruning skips only nodes that could not be kept: tests/test_graphed_growth.py), its nodes
in drafting order (each parent before its children), which the device's greedy step (models/engine/device_step.py)
verifies and accepts as they are. Greedy acceptance only: the other rules walk the tree's buffers on the host.
"""
from __future__ import annotations

import torch

from models.engine.drafters.base import DeviceTree
from models.engine.drafters.graphed import GREEDY, GraphedDraft
from models.engine.drafters.proposer import Frontier, Proposer, proposer_device, select_children, to_token_ids
from models.engine.trees import GrownTree


def drafted_before(level: int, top_k: int) -> int:
    """Nodes drafted before `level` of a fixed-shape growth (the root, top_k, then top_k x top_k a level)."""
    return 1 if level == 0 else 1 + top_k + (level - 1) * top_k * top_k


def frontier_rows(levels: int, top_k: int) -> int:
    """Rows a fixed-shape growth of `levels` levels runs through the proposer (what it makes room for)."""
    return 1 + max(levels - 1, 0) * top_k


class GraphedGrowth(GraphedDraft):
    """One grown tree's drafts by one proposer at fixed shapes (module docstring); `levels` as the drafter drafts
    them (depth + 1, no more than the proposer can)."""

    def __init__(self, proposer: Proposer, tree: GrownTree, levels: int, capture: bool):
        super().__init__(proposer, None, capture)
        self.tree, self.levels, k = tree, levels, tree.top_k
        self.size = drafted_before(levels, k)                   # every node drafted, root included
        self.kept = min(tree.nodes + 1, self.size)
        device = proposer_device(proposer)
        self.depth = torch.zeros(self.size, dtype=torch.long, device=device)
        self.new = []                                           # each level's node indices
        for d in range(levels):
            new = torch.arange(drafted_before(d, k), drafted_before(d + 1, k), device=device)
            self.depth[new] = d + 1
            self.new.append(new)
        self.tokens_all = torch.zeros(self.size, dtype=torch.long, device=device)
        self.parent = torch.full((self.size,), -1, dtype=torch.long, device=device)
        self.score = torch.zeros(self.size, device=device)
        self.ancestors = torch.zeros(self.size, self.size, dtype=torch.bool, device=device)
        self.ancestors[0, 0] = True                            # the root's row; every other row is rewritten
        self.path = torch.zeros(self.size, levels + 1, dtype=torch.long, device=device)

    @property
    def num_nodes(self) -> int:
        """Rows a growth runs through the proposer: the root, then top_k frontier nodes a level."""
        return frontier_rows(self.levels, self.tree.top_k)

    def _frontier(self, d: int, nodes: torch.Tensor) -> Frontier:
        n = drafted_before(d, self.tree.top_k)
        return Frontier(d, nodes, self.parent[nodes], self.tokens_all[self.path[nodes, :d + 1]],
                        self.ancestors[nodes, :n], self.tokens_all[:n])

    def _level(self, d: int, frontier: torch.Tensor) -> torch.Tensor:
        """Level d's children of `frontier` written into the buffers -> the next frontier (their top_k)."""
        k, new = self.tree.top_k, self.new[d]
        logits = self.proposer.scores(self._frontier(d, frontier))                      # [R or 1, Vd]
        kids = select_children(logits, k, GREEDY, want_logp=True)
        R = frontier.numel()
        picks, logp = kids.picks.expand(R, -1), kids.logp.expand(R, -1)
        par = frontier.repeat_interleave(k)
        self.tokens_all[new] = to_token_ids(self.proposer, picks).reshape(-1)
        self.parent[new] = par
        # log-softmax of a top value is <= 0 up to rounding: clamped, so a child never outscores its parent
        self.score[new] = self.score[par] + logp.reshape(-1).float().clamp(max=0.0)
        self.ancestors[new] = self.ancestors[par]
        self.ancestors[new, new] = True
        self.path[new] = self.path[par]
        self.path[new, d + 1] = new
        return new[torch.sort(self.score[new], descending=True, stable=True).indices[:k]]

    def _walk(self) -> tuple[torch.Tensor, ...]:
        self.tokens_all[:1].copy_(self.root)
        frontier = self.new[0][:1] * 0                                                  # the root, node 0
        self.proposer.begin(self.root, self.levels)
        try:
            for d in range(self.levels):
                frontier = self._level(d, frontier)
        finally:
            self.proposer.end()
        order = torch.sort(self.score, descending=True, stable=True).indices[:self.kept]     # ties: earlier first
        keep = order.sort().values                                                       # drafting order
        parent = torch.searchsorted(keep, self.parent[keep].clamp(min=0))               # root: itself
        return self.tokens_all[keep], self.ancestors[keep][:, keep], self.depth[keep], parent

    def draft(self, root: int) -> DeviceTree:
        return DeviceTree(*super().draft(root))

    def summary(self) -> dict:
        return {"mode": self.mode, "tree": self.tree.name, "nodes": self.kept - 1, "drafted": self.size - 1,
                "fallback": self.fallback}
