"""A drafted tree, optionally cut per step by cost (tree=optimal, sparse64, chain4, cut): the proposals of the
proposer of the heads' method (heads.method.proposer; proposer.py), walked depth by depth over the fixed tree; or a tree grown
per step (tree=eagle2, dynamic_optimal: grown.py), built from the same spec kind.

    drafter = make_drafter({"kind": "heads", "tree": spec, "step_cost": costs}, heads=heads)
"""
from __future__ import annotations

from dataclasses import replace

import torch

from models.engine.drafters.base import DeviceTree, Draft, DraftContext
from models.engine.drafters.cut import checked_step_costs, cut_by_cost
from models.engine.drafters.graphed import GraphedDraft, prepare_static, why_not_capturable
from models.engine.drafters.grown import GrownTreeDrafter
from models.engine.drafters.proposer import Proposer, draft_tree, draft_trees, proposer_for
from models.engine.trees import GrownTree, TreeBuffers, TreeSpec


class TreeDrafter:
    """The proposals on a fixed tree, cut to max_depth near the limits.

    step_cost (relative cost of a step verifying 1, 2, ... tokens; e.g. the latency profile): every step keeps
    only the drafted nodes that pay for their verify cost by the drafter's own probabilities (cut_by_cost; no
    node: a plain 1-token step). Greedy and typical acceptance only: sampled drafts keep the whole tree (their
    acceptance rule needs every draw below a parent). want_probs: every Draft carries node_probs. proposer:
    given instead of heads (a bare draft module's)."""

    def __init__(self, heads, tree: TreeSpec | TreeBuffers, step_cost: list[float] | None = None,
                 want_probs: bool = False, proposer: Proposer | None = None):
        spec = tree.spec if isinstance(tree, TreeBuffers) else tree
        if heads is not None:
            spec.check_heads(heads.config.num_heads)
        self.buf = TreeBuffers.build(spec)
        self.step_cost = checked_step_costs(step_cost)
        self.proposer = proposer or proposer_for(heads)
        self.want_probs = want_probs or self.step_cost is not None
        self.taps = tuple(self.proposer.taps)     # base states the proposer reads (EAGLE-3), else none
        self.sampling, self.generator, self.cutting = None, None, False
        self.graphed: GraphedDraft | None = None  # the whole tree's draft as a CUDA graph, kept across decodes
        self.static, self.not_graphed = False, "fixed-shape drafts not asked for (DraftContext.static)"
        self.device_tree = False                  # drafts handed on as DeviceTrees (greedy, static, alone)

    def start(self, ctx: DraftContext) -> None:
        self.sampling, self.generator = ctx.sampling, ctx.generator
        self.cutting = self.step_cost is not None and not ctx.sampling.samples_drafts
        why = why_not_capturable(self.proposer, ctx.sampling, self.cutting, self.want_probs) if ctx.static else \
            "fixed-shape drafts not asked for (DraftContext.static)"
        self.static, self.not_graphed = why is None, why
        self.device_tree = self.static and ctx.sampling.greedy and ctx.on_device   # accepted on the device
        self.proposer.start(replace(ctx, static=self.static))     # the proposer's state at fixed shapes, or not
        if self.static and self.graphed is None:
            self.graphed = GraphedDraft(self.proposer, self.buf, capture=True)

    def draft(self, root: int, max_depth: int) -> Draft:
        buf = self.buf.to_depth(max_depth)
        if self.static:
            if buf is self.buf:                       # the whole tree: the graph
                tokens = self.graphed.draft(root)
                return on_device(buf, tokens) if self.device_tree else Draft(buf, tokens)
            prepare_static(self.proposer, buf.num_tokens)     # near the limits: a smaller tree, eagerly
        tokens, draft_q, probs = draft_tree(self.proposer, root, buf, self.sampling, self.generator, self.want_probs)
        if self.cutting and buf.num_tokens > 1:
            keep = cut_by_cost(probs.tolist(), self.step_cost)
            if len(keep) < buf.num_tokens:
                buf, tokens, probs = buf.subtree(keep), tokens[list(keep)], probs[list(keep)]
        return Draft(buf, tokens, draft_q, probs)

    def advance(self, hidden: torch.Tensor, tokens: list[int], position: int) -> None:
        self.proposer.advance(hidden, tokens, position)

    def rewind(self, position: int) -> None:
        self.proposer.rewind(position)

    def graph_summary(self) -> dict:
        """Whether drafts replay a CUDA graph (graphed.py), and why not where they do not."""
        if self.static:
            return self.graphed.summary()
        return {"mode": "eager", "tree": self.buf.spec.name, "nodes": self.buf.num_tokens - 1,
                "fallback": self.not_graphed}


def on_device(buf: TreeBuffers, tokens: torch.Tensor) -> DeviceTree:
    """A fixed tree's replayed draft as a DeviceTree: verified and accepted greedily on the device, read once
    (acceptance.accept_on_device). Its nodes are ordered by depth, so every parent comes first."""
    device = tokens.device
    return DeviceTree(tokens, buf.on("tree_mask", device)[0, 0], buf.on("depth", device),
                      buf.on("parent", device).clamp(min=0))


def draft_many(drafters: list, roots: list[int], depths: list[int]) -> list[Draft | None]:
    """The drafts of a batch's drafters (models/engine/batch.py), one per sequence: those that are eager fixed-tree
    TreeDrafters drafting greedy or top-k children on the same (cut) tree go through proposer.draft_trees together,
    the others draft alone."""
    out: list[Draft | None] = [None] * len(drafters)
    groups: dict[tuple, list[int]] = {}
    for i, (d, depth) in enumerate(zip(drafters, depths)):
        if isinstance(d, TreeDrafter) and not d.static and not d.want_probs and d.sampling is not None \
                and not d.sampling.samples_drafts:
            buf = d.buf.to_depth(depth)
            groups.setdefault((id(buf), type(d.proposer)), []).append(i)
        else:
            out[i] = d.draft(roots[i], depth)
    for members in groups.values():
        first = drafters[members[0]]
        buf = first.buf.to_depth(depths[members[0]])
        tokens = draft_trees([drafters[i].proposer for i in members], [roots[i] for i in members], buf,
                             first.sampling, [drafters[i].generator for i in members])
        for i, t in zip(members, tokens):
            out[i] = Draft(buf, t)
    return out


def tree_drafter(heads, tree: TreeSpec | TreeBuffers | GrownTree, step_cost: list[float] | None = None,
                 want_probs: bool = False) -> TreeDrafter | GrownTreeDrafter:
    """The proposals of `heads` on a fixed tree (optionally cut by cost) or on a tree grown per step."""
    if not isinstance(tree, GrownTree):
        return TreeDrafter(heads, tree, step_cost, want_probs)
    if step_cost is not None:
        raise ValueError(f"grown tree {tree.name!r} with cut_by_cost: a grown tree picks its nodes itself "
                         "(its `nodes`); cut a fixed tree instead (tree=cut)")
    return GrownTreeDrafter(heads, tree)


def build(spec: dict, heads=None, **_) -> TreeDrafter | GrownTreeDrafter:
    """spec: tree (TreeSpec, TreeBuffers or GrownTree), step_cost (optional), want_probs (optional); heads: DraftHeads."""
    if heads is None or spec.get("tree") is None:
        raise ValueError("a heads drafter needs heads=... and a tree in its spec")
    return tree_drafter(heads, spec["tree"], spec.get("step_cost"), bool(spec.get("want_probs", False)))
