"""A tree grown anew at every step from the draft's own probabilities (EAGLE-2's dynamic tree), over any method's
proposer (proposer.py), through begin / scores / end and select_children only.

    drafter = make_drafter({"kind": "heads", "tree": GrownTree("eagle2", depth=5, top_k=10, nodes=59)}, heads=heads)

A node's score is its cumulative log-probability: the sum of the draft's log-softmax along the path root .. node
(Medusa: of each depth's head; Hydra, Hydra++: of each head given the path; EAGLE, EAGLE-3, the draft model: of
the draft conditioned on the path). Each step:
  1. the root's top_k children are drafted (one scores call);
  2. `depth` times: of the nodes of the deepest level, the top_k by score form the frontier, and one scores call
     over the whole frontier gives each of them its top_k children;
  3. every drafted node is ranked by score and the best `nodes` are kept. A child's score is at most its
     parent's, and ties rank the earlier-drafted node first, so the kept set holds every kept node's ancestors:
     it is a tree, verified as any other (its TreeBuffers are built from the kept nodes' rank paths).
Pruned growth: once nodes + 1 nodes are drafted, a frontier node scoring at or below the (nodes + 1)-th best score is
not expanded, and growth stops when no frontier node is left. Its descendants could not be kept: each would score at
most what it does and rank after the nodes + 1 drafted before it. Nor would they change which nodes are expanded
where it matters: a node they would push out of a frontier scores no more than they do, so it is pruned too. The kept
tree is the unpruned growth's, token, path and score alike (tests/test_grown_tree.py), for fewer frontier rows and levels.
Levels drafted: depth + 1, no more than the proposer can (draft heads: their number; max_depth near the limits).
Children are top-k picks, so every child is a point mass for the acceptance rules: greedy and typical acceptance
and sampling acceptance with draft="topk" stay exact. draft="sample" is refused: step 3 drops draws, and the
sampling rule is exact only over all the children drawn below a node.
With static drafts and greedy decoding (DraftContext.static, on_device) the growth runs unpruned at fixed shapes on
the device instead, replayed as a CUDA graph where there is one (graphed_growth.py): the same kept tree, handed on as
a DeviceTree that the decode step verifies and accepts there (acceptance.accept_on_device).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from models.engine.drafters.base import DeviceTree, Draft, DraftContext
from models.engine.drafters.graphed import prepare_static, why_not_capturable
from models.engine.drafters.graphed_growth import GraphedGrowth
from models.engine.drafters.growth import Grown, frontier_rows, grow
from models.engine.drafters.proposer import Proposer, proposer_device, proposer_for
from models.engine.trees import GrownTree, TreeBuffers, TreeSpec

__all__ = ["GrownTreeDrafter", "Grown", "grow"]


class GrownTreeDrafter:
    """The proposer's tree grown per step (module docstring). proposer: given instead of heads (a bare module's)."""

    def __init__(self, heads, tree: GrownTree, proposer: Proposer | None = None):
        self.tree = tree
        self.proposer = proposer or proposer_for(heads)
        vocab = self.proposer.vocab_size if self.proposer.draft_ids is None else len(self.proposer.draft_ids)
        if tree.top_k > vocab:
            raise ValueError(f"grown tree {tree.name!r}: top_k={tree.top_k} is larger than the draft vocabulary "
                             f"({vocab} tokens); use top_k <= {vocab}")
        self.max_levels = getattr(self.proposer, "max_depth", None)    # draft heads: their number; None: any
        self.taps = tuple(self.proposer.taps)
        self.sampling, self.generator = None, None
        self.graphed: GraphedGrowth | None = None   # the growth at fixed shapes, kept across decodes
        self.static, self.not_graphed = False, "not started"

    def start(self, ctx: DraftContext) -> None:
        if ctx.sampling.samples_drafts:
            raise ValueError(f"grown tree {self.tree.name!r} with draft='sample': the tree keeps only the best-scoring "
                             "of the children drawn below a node, and lossless sampling needs every draw; use "
                             "draft='topk' (exact: each child a point mass), greedy or typical acceptance, or a "
                             "fixed tree")
        self.not_graphed = self.why_eager(ctx)
        self.static = self.not_graphed is None
        self.proposer.start(replace(ctx, static=self.static))     # fixed-shape state for a growth at fixed shapes
        self.sampling, self.generator = ctx.sampling, ctx.generator
        full = self.levels(self.tree.levels)
        if self.static and (self.graphed is None or self.graphed.levels != full):
            self.graphed = GraphedGrowth(self.proposer, self.tree, full, capture=True) if full else None
            self.static = full > 0

    def why_eager(self, ctx: DraftContext) -> str | None:
        """Why the growth runs eagerly on the host (pruned, the kept tree's buffers built there), or None: at fixed
        shapes on the device (graphed_growth.py)."""
        if not ctx.static:
            return "fixed-shape drafts not asked for (DraftContext.static)"
        if not ctx.sampling.greedy:
            return "only greedy acceptance runs on the device (the other rules walk the tree's buffers)"
        if not ctx.on_device:
            return "the caller reads the tree's buffers on the host (a lookup branch merged in)"
        return why_not_capturable(self.proposer, ctx.sampling, cutting=False, want_probs=False)

    def levels(self, max_depth: int) -> int:
        cap = self.tree.levels if self.max_levels is None else min(self.tree.levels, self.max_levels)
        return max(0, min(cap, max_depth))

    def draft(self, root: int, max_depth: int) -> Draft | DeviceTree:
        levels = self.levels(max_depth)
        if levels == 0:
            buf = TreeBuffers.build(TreeSpec(self.tree.name, (), self.tree.top_k))
            return Draft(buf, torch.tensor([root], device=proposer_device(self.proposer)), None, torch.ones(1))
        if self.static:
            if levels == self.graphed.levels:
                return self.graphed.draft(root)
            prepare_static(self.proposer, frontier_rows(levels, self.tree.top_k))     # near the limits: eagerly
        grown = grow(self.proposer, root, self.tree, levels, self.sampling, self.generator)
        return as_draft(grown, grown.best(self.tree.nodes), self.tree)

    def graph_summary(self) -> dict:
        """Whether the growth runs at fixed shapes on the device (replayed as a graph), and why not."""
        if self.static:
            return self.graphed.summary()
        return {"mode": "eager", "tree": self.tree.name, "nodes": self.tree.nodes, "fallback": self.not_graphed}

    def advance(self, hidden: torch.Tensor, tokens: list[int], position: int) -> None:
        self.proposer.advance(hidden, tokens, position)

    def rewind(self, position: int) -> None:
        self.proposer.rewind(position)


def as_draft(grown: Grown, keep: torch.Tensor, tree: GrownTree) -> Draft:
    """The kept nodes as a Draft: their rank paths make the TreeSpec, tokens and probabilities follow its node
    order (TreeBuffers: by depth, then path)."""
    keep_list, ranks, path = keep.tolist(), grown.rank.tolist(), grown.path[keep].tolist()
    depth = grown.ancestors[keep, :grown.n].sum(-1).sub(1).tolist()
    paths = [tuple(ranks[j] for j in row[1:dk + 1]) for row, dk in zip(path, depth)]      # root: ()
    order = sorted(range(len(keep_list)), key=lambda i: (len(paths[i]), paths[i]))
    buf = TreeBuffers.build(TreeSpec(tree.name, tuple(paths[i] for i in order[1:]), tree.top_k))
    nodes = keep[torch.tensor(order, device=keep.device)]
    return Draft(buf, grown.tokens[nodes], None, grown.score[nodes].exp().cpu())
