"""Drafters, one module each, built by make_drafter from a spec (models/engine/drafters/base.py):

    heads           a method's proposer on a fixed tree, optionally cut per step      tree.py (proposer.py: the
                    by cost, or on a tree grown per step (GrownTree)                   protocol; grown.py)
    prompt_lookup   a chain copied from the context                                    prompt_lookup.py
    heads_lookup    the heads' tree with prompt lookup's chain merged in               lookup_branch.py
    fixed           a fixed chain, for timing and tests                                fixed.py
    eagle           a bare EAGLE-1 layer on a fixed tree (registered by models/shared/autoregressive/proposer.py)
"""
from models.engine.drafters import fixed, lookup_branch, prompt_lookup, tree  # noqa: F401  (register their kinds)
from models.engine.drafters.base import (DRAFTERS, Draft, DraftContext, StepDrafter, make_drafter,  # noqa: F401
                                         register_drafter)
from models.engine.drafters.cut import checked_step_costs, cut_by_cost  # noqa: F401
from models.engine.drafters.fixed import FixedDrafter  # noqa: F401
from models.engine.drafters.grown import GrownTreeDrafter  # noqa: F401
from models.engine.drafters.lookup_branch import LookupBranchDrafter  # noqa: F401
from models.engine.drafters.prompt_lookup import NgramIndex, PromptLookupDrafter  # noqa: F401
from models.engine.drafters.proposer import (Frontier, Proposer, draft_tree, proposer_for,  # noqa: F401
                                             register_proposer, select_children)
from models.engine.drafters.tree import TreeDrafter, tree_drafter  # noqa: F401


def heads_drafter(heads, tree, step_cost: list[float] | None = None, lookup: PromptLookupDrafter | None = None,
                  want_probs: bool = False) -> StepDrafter:
    """The drafter for heads on `tree` from objects at hand (make_drafter builds the same from a spec): cut per
    step when step_cost is given, with `lookup`'s chain merged in when it is given."""
    if lookup is not None:
        return LookupBranchDrafter(heads, tree, lookup, step_cost)
    return tree_drafter(heads, tree, step_cost, want_probs)
