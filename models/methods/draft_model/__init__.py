"""A small draft model (Leviathan et al. 2023; docs/reference.md#autoregressive-drafters): a few decoder layers of the
base's width over the tokens alone, drafted and trained on EAGLE's code paths (models/shared/autoregressive/).

- draft_model.py: the module (DraftModel: copies of base layers, its own KV cache) and its causal-LM twin;
- family.py: its family (the attribute the module is held under, how it is built).
"""
from models.methods.draft_model.family import DraftModelFamily
from models.shared.autoregressive.proposer import AutoregressiveProposer
from models.shared.autoregressive.training import AutoregressiveFitModule
from models.shared.method import Method, RecipeKind

DRAFT_MODEL = Method(name="draft_model", family=DraftModelFamily(), proposer=AutoregressiveProposer,
                     recipes=(RecipeKind("draft_model", AutoregressiveFitModule),))
