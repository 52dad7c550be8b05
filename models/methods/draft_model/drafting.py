"""The draft model's proposer, registered with the engine: the autoregressive proposer (models/shared/
autoregressive_proposer.py), as EAGLE's. Imported by models/methods/drafting.py where heads decode."""
from __future__ import annotations

from models.engine.drafters.proposer import register_proposer
from models.shared.autoregressive.proposer import AutoregressiveProposer
from models.shared.families import family_of
from models.methods.draft_model.family import DraftModelFamily


@register_proposer
def draft_model_proposer(heads):
    """The proposer of draft-model heads (and their subclasses'); None for others."""
    return AutoregressiveProposer(heads=heads) if isinstance(family_of(heads), DraftModelFamily) else None
