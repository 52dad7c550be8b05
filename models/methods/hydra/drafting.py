"""Hydra's and Hydra++'s proposer, registered with the engine: the per-depth heads' proposer (models/shared/heads_proposer.py),
depth d scored from its frontier's paths; for Hydra++ h_t comes from the prefix layer (read_hidden) fed accepted
positions only. Imported by models/methods/drafting.py where heads decode."""
from __future__ import annotations

from models.engine.drafters.proposer import register_proposer
from models.shared.families import family_of
from models.shared.heads_proposer import HeadsProposer
from models.methods.hydra.family import Hydra


@register_proposer
def hydra_proposer(heads):
    """The proposer of Hydra and Hydra++ heads (and their subclasses'); None for others."""
    return HeadsProposer(heads) if isinstance(family_of(heads), Hydra) else None
