"""Drafters, one module each, built by make_drafter from a spec (models/engine/drafters/base.py):

    heads           draft heads on a fixed tree, optionally cut per step by cost      tree.py (heads.py drafts;
                    EAGLE heads: eagle.py)
    prompt_lookup   a chain copied from the context                                    prompt_lookup.py
    heads_lookup    the heads' tree with prompt lookup's chain merged in               lookup_branch.py
    fixed           a fixed chain, for timing and tests                                fixed.py
    eagle           a bare EAGLE-1 layer on a fixed tree, full vocabulary              tree.py (eagle.py drafts)
"""
from models.engine.drafters import eagle, fixed, lookup_branch, prompt_lookup, tree  # noqa: F401  (register their kinds)
from models.engine.drafters.base import (DRAFTERS, Draft, DraftContext, StepDrafter, make_drafter,  # noqa: F401
                                         register_drafter)
from models.engine.drafters.cut import checked_step_costs, cut_by_cost  # noqa: F401
from models.engine.drafters.eagle import EagleProposer  # noqa: F401
from models.engine.drafters.fixed import FixedDrafter  # noqa: F401
from models.engine.drafters.heads import HeadsDrafter  # noqa: F401
from models.engine.drafters.lookup_branch import LookupBranchDrafter  # noqa: F401
from models.engine.drafters.prompt_lookup import NgramIndex, PromptLookupDrafter  # noqa: F401
from models.engine.drafters.tree import EagleDrafter, TreeDrafter, proposer_for  # noqa: F401


def heads_drafter(heads, tree, step_cost: list[float] | None = None, lookup: PromptLookupDrafter | None = None,
                  want_probs: bool = False) -> StepDrafter:
    """The drafter for heads on `tree` from objects at hand (make_drafter builds the same from a spec): cut per
    step when step_cost is given, with `lookup`'s chain merged in when it is given."""
    if lookup is not None:
        return LookupBranchDrafter(heads, tree, lookup, step_cost)
    return TreeDrafter(heads, tree, step_cost, want_probs)
