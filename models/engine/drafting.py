"""Drafters, one module each under models/engine/drafters/, built by make_drafter from a spec (drafters/base.py: the
protocol):

    heads           a method's proposer on a fixed tree, optionally cut per step      tree.py (proposer.py: the
                    by cost, or on a tree grown per step (GrownTree)                   protocol; grown.py)
    prompt_lookup   a chain copied from the context                                    prompt_lookup.py
    heads_lookup    the heads' tree with prompt lookup's chain merged in               lookup_branch.py
    fixed           a fixed chain, for timing and tests                                fixed.py

DRAFTERS lists the kinds a spec may name; a new kind is its module and one entry there.
"""
from typing import Callable

from models.engine.drafters import fixed, lookup_branch, prompt_lookup, tree
from models.engine.drafters.base import Draft, DraftContext, StepDrafter
from models.engine.drafters.cut import checked_step_costs, cut_by_cost
from models.engine.drafters.fixed import FixedDrafter
from models.engine.drafters.grown import GrownTreeDrafter
from models.engine.drafters.lookup_branch import LookupBranchDrafter
from models.engine.drafters.prompt_lookup import NgramIndex, PromptLookupDrafter
from models.engine.drafters.proposer import Frontier, Proposer, draft_tree, proposer_for, select_children
from models.engine.drafters.tree import TreeDrafter, tree_drafter

__all__ = ["DRAFTERS", "Draft", "DraftContext", "FixedDrafter", "Frontier", "GrownTreeDrafter", "LookupBranchDrafter",
           "NgramIndex", "PromptLookupDrafter", "Proposer", "StepDrafter", "TreeDrafter", "checked_step_costs",
           "cut_by_cost", "draft_tree", "heads_drafter", "make_drafter", "proposer_for", "select_children",
           "tree_drafter"]

# kind -> builder(spec: dict, **parts) -> StepDrafter
DRAFTERS: dict[str, Callable[..., StepDrafter]] = {
    "heads": tree.build, "prompt_lookup": prompt_lookup.build, "heads_lookup": lookup_branch.build,
    "fixed": fixed.build,
}


def make_drafter(spec, **parts) -> StepDrafter | None:
    """A drafter from its spec (a mapping with "kind" and that kind's settings; "none" or None: no drafter) and
    the parts it needs that a config cannot hold (heads=..., lookup=...)."""
    if spec is None:
        return None
    spec = dict(spec)
    kind = spec.pop("kind", None)
    if kind == "none":
        return None
    if kind not in DRAFTERS:
        raise ValueError(f"drafter kind {kind!r} is not known; accepted: {', '.join(sorted(DRAFTERS))}")
    return DRAFTERS[kind](spec, **parts)


def heads_drafter(heads, tree, step_cost: list[float] | None = None, lookup: PromptLookupDrafter | None = None,
                  want_probs: bool = False) -> StepDrafter:
    """The drafter for heads on `tree` from objects at hand (make_drafter builds the same from a spec): cut per
    step when step_cost is given, with `lookup`'s chain merged in when it is given."""
    if lookup is not None:
        return LookupBranchDrafter(heads, tree, lookup, step_cost)
    return tree_drafter(heads, tree, step_cost, want_probs)
