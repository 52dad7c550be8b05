"""Every method's proposer, registered with the engine (models/engine/drafters/proposer.py): import this module where
heads decode. Kept apart from the methods' families and recipes (models/methods/__init__.py) so that training, which
never drafts, does not run the engine's drafters.

    import models.methods.drafting  # noqa: F401
    drafter = make_drafter({"kind": "heads", "tree": spec}, heads=heads)
"""
import models.methods  # noqa: F401  (the families the proposers recognise)
from models.methods.medusa import drafting as medusa_drafting  # noqa: F401
from models.methods.hydra import drafting as hydra_drafting  # noqa: F401
from models.methods.eagle import drafting as eagle_drafting  # noqa: F401
from models.methods.draft_model import drafting as draft_model_drafting  # noqa: F401
