"""EAGLE-2's grown tree at fixed shapes, computed on the device and replayed as one CUDA graph.

    growth = GraphedGrowth(proposer, tree, levels, capture=True)     # kept by the GrownTreeDrafter across decodes
    grown = growth.draft(root)        # a DeviceTree: tokens, ancestors, depths, parents of the kept nodes, on device

The eager growth (grown.py) is host-bound on a GPU: it reads every level's scores back to rank them, prunes, and
builds the kept tree's buffers in Python (EAGLE's draft took 13.4 ms of wall time for 2.3 ms of kernels on an
H200). Its shapes are fixed level by level, as SGLang's EAGLE worker relies on: level 0 gives the root top_k
children, every later level gives the top_k best of the previous level's children top_k children each. So here
growth.py's growth runs unpruned (prune=False), which reads nothing back: its buffers live on the device, and the
scores (cumulative log-probabilities), the frontier (a stable sort of the level's scores, ties to the earlier node),
the final `nodes` best (Grown.best_indices, stable too) and the kept tree's ancestor mask, depths and parents are
computed there. So the whole walk is one graph, captured on first use and replayed after; off CUDA the same walk
runs eagerly. The kept tree is the pruned growth's (pruning skips only nodes that could not be kept:
tests/test_graphed_growth.py), its nodes in drafting order (each parent before its children), which the decode
step verifies and accepts (acceptance.accept_on_device) as they are. Greedy acceptance only: the other rules walk the tree's buffers on the host.
"""
from __future__ import annotations

import torch

from models.engine.drafters.base import DeviceTree
from models.engine.drafters.graphed import GREEDY, GraphedDraft
from models.engine.drafters.growth import drafted_before, frontier_rows, grow
from models.engine.drafters.proposer import Proposer
from models.engine.trees import GrownTree


class GraphedGrowth(GraphedDraft):
    """One grown tree's drafts by one proposer at fixed shapes (module docstring); `levels` as the drafter drafts
    them (depth + 1, no more than the proposer can)."""

    def __init__(self, proposer: Proposer, tree: GrownTree, levels: int, capture: bool):
        super().__init__(proposer, None, capture)
        self.tree, self.levels = tree, levels
        self.size = drafted_before(levels, tree.top_k)          # every node drafted, root included
        self.kept = min(tree.nodes + 1, self.size)

    @property
    def num_nodes(self) -> int:
        """Rows a growth runs through the proposer: the root, then top_k frontier nodes a level."""
        return frontier_rows(self.levels, self.tree.top_k)

    def _walk(self) -> tuple[torch.Tensor, ...]:
        grown = grow(self.proposer, self.root, self.tree, self.levels, GREEDY, prune=False)    # no read-back
        keep = grown.best_indices(self.tree.nodes)                                           # drafting order
        depth = grown.ancestors[keep].sum(-1) - 1
        parent = torch.searchsorted(keep, grown.parent[keep].clamp(min=0))                  # root: itself
        return grown.tokens[keep], grown.ancestors[keep][:, keep], depth, parent

    def draft(self, root: int) -> DeviceTree:
        return DeviceTree(*super().draft(root))

    def summary(self) -> dict:
        return {"mode": self.mode, "tree": self.tree.name, "nodes": self.kept - 1, "drafted": self.size - 1,
                "fallback": self.fallback}
