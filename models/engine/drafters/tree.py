"""A drafted tree, optionally cut per step by cost (tree=optimal, sparse64, chain4, dynamic): the heads' proposals
(heads.py), or EAGLE's when the heads are of an autoregressive family (eagle.py).

    drafter = make_drafter({"kind": "heads", "tree": spec, "step_cost": costs}, heads=heads)
    drafter = make_drafter({"kind": "eagle", "tree": spec}, eagle=eagle_module)     # a bare EagleModule
"""
from __future__ import annotations

import torch

from models.engine.drafters.base import Draft, DraftContext, register_drafter
from models.engine.drafters.cut import checked_step_costs, cut_by_cost
from models.engine.drafters.eagle import EagleProposer
from models.engine.drafters.heads import HeadsDrafter
from models.engine.trees import TreeBuffers, TreeSpec


def proposer_for(heads, want_probs: bool = False):
    """What drafts the tree for `heads`: EAGLE's layer for an autoregressive family, else the heads themselves."""
    family = getattr(heads, "family", None)
    if getattr(family, "autoregressive", False):
        return EagleProposer(heads=heads, want_probs=want_probs)
    return HeadsDrafter(heads, want_probs=want_probs)


class TreeDrafter:
    """The proposals on a fixed tree, cut to max_depth near the limits.

    step_cost (relative cost of a step verifying 1, 2, ... tokens; e.g. the latency profile): every step keeps
    only the drafted nodes that pay for their verify cost by the drafter's own probabilities (cut_by_cost; no
    node: a plain 1-token step). Greedy and typical acceptance only: sampled drafts keep the whole tree (their
    acceptance rule needs every draw below a parent). want_probs: every Draft carries node_probs. proposer:
    given instead of heads (EagleDrafter)."""

    def __init__(self, heads, tree: TreeSpec | TreeBuffers, step_cost: list[float] | None = None,
                 want_probs: bool = False, proposer=None):
        spec = tree.spec if isinstance(tree, TreeBuffers) else tree
        if heads is not None:
            spec.check_heads(heads.config.num_heads)
        self.buf = TreeBuffers.build(spec)
        self.step_cost = checked_step_costs(step_cost)
        self.proposer = proposer or proposer_for(heads, want_probs or self.step_cost is not None)
        self.taps = getattr(self.proposer, "taps", ())     # base states the proposer reads (EAGLE-3), else none
        self.cutting = False

    def start(self, ctx: DraftContext) -> None:
        self.proposer.start(ctx.hidden, ctx.sampling, ctx.generator, input_ids=ctx.input_ids)
        self.cutting = self.step_cost is not None and not ctx.sampling.samples_drafts

    def draft(self, root: int, max_depth: int) -> Draft:
        buf = self.buf.to_depth(max_depth)
        tokens, draft_q, probs = self.proposer.draft(root, buf)
        if self.cutting and buf.num_tokens > 1:
            keep = cut_by_cost(probs.tolist(), self.step_cost)
            if len(keep) < buf.num_tokens:
                buf, tokens, probs = buf.subtree(keep), tokens[list(keep)], probs[list(keep)]
        return Draft(buf, tokens, draft_q, probs)

    def advance(self, hidden: torch.Tensor, tokens: list[int], position: int) -> None:
        self.proposer.advance(hidden, position, tokens=tokens)

    def rewind(self, position: int) -> None:
        self.proposer.rewind(position)


class EagleDrafter(TreeDrafter):
    """A bare EagleModule (no DraftHeads) on a tree: the base LM head over the full vocabulary (conformance with
    the official code, tests). cache and feature are its proposer's."""

    def __init__(self, eagle, tree: TreeSpec | TreeBuffers, want_probs: bool = False,
                 step_cost: list[float] | None = None):
        super().__init__(None, tree, step_cost, want_probs,
                         proposer=EagleProposer(eagle=eagle, want_probs=want_probs or step_cost is not None))

    @property
    def cache(self):
        return self.proposer.cache

    @property
    def feature(self) -> torch.Tensor:
        return self.proposer.feature


@register_drafter("heads")
def build(spec: dict, heads=None, **_) -> TreeDrafter:
    """spec: tree (TreeSpec or TreeBuffers), step_cost (optional), want_probs (optional); heads: DraftHeads."""
    if heads is None or spec.get("tree") is None:
        raise ValueError("a heads drafter needs heads=... and a tree in its spec")
    return TreeDrafter(heads, spec["tree"], spec.get("step_cost"), bool(spec.get("want_probs", False)))


@register_drafter("eagle")
def build_eagle(spec: dict, eagle=None, **_) -> EagleDrafter:
    """spec: tree (TreeSpec or TreeBuffers), want_probs, step_cost (optional); eagle: models.heads.eagle.EagleModule."""
    missing = [what for what, have in (("eagle=EagleModule(...)", eagle is not None),
                                       ("a tree in its spec", spec.get("tree") is not None)) if not have]
    if missing:
        raise ValueError(f"an eagle drafter needs {' and '.join(missing)}")
    return EagleDrafter(eagle, spec["tree"], bool(spec.get("want_probs", False)), spec.get("step_cost"))
