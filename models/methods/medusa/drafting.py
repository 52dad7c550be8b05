"""Medusa's proposer, registered with the engine: the per-depth heads' proposer (models/shared/heads_proposer.py), every head
run once per tree on h_t. Imported by models/methods/drafting.py where heads decode."""
from __future__ import annotations

from models.engine.drafters.proposer import register_proposer
from models.shared.families import family_of
from models.shared.heads_proposer import HeadsProposer
from models.methods.medusa.family import Medusa


@register_proposer
def medusa_proposer(heads):
    """The proposer of Medusa heads (and their subclasses'); None for others."""
    return HeadsProposer(heads) if isinstance(family_of(heads), Medusa) else None
