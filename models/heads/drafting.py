"""The head methods' proposers, registered with the engine: import this module where heads decode (the engine
asks registered factories for a proposer and never imports a method; training does not need them). A family
drafts with AutoregressiveProposer when it is autoregressive (EAGLE, EAGLE-3, the draft model and their
subclasses), else with HeadsProposer (Medusa, Hydra, Hydra++ and theirs).

    import models.heads.drafting  # noqa: F401
    drafter = heads_drafter(heads, tree)
"""
from __future__ import annotations

from models.engine.drafters.proposer import register_proposer
from models.heads.autoregressive_proposer import AutoregressiveProposer
from models.heads.families import FAMILIES
from models.heads.proposers import HeadsProposer


@register_proposer
def family_proposer(heads):
    """The proposer of heads whose config names a registered head family; None for other heads."""
    family = FAMILIES.get(getattr(getattr(heads, "config", None), "family", None))
    if family is None:
        return None
    return AutoregressiveProposer(heads=heads) if family.autoregressive else HeadsProposer(heads)
