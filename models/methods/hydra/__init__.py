"""Hydra and Hydra++ (docs/reference.md#heads): sequentially dependent heads, head k reading the embeddings of the path
above its node; Hydra++ reads the base's hidden states through its own prefix decoder layer.

- family.py: the families (HydraInputBlock);
- prefix.py: HydraPPHeads, the heads module that owns Hydra++'s prefix layer and final norm (read_hidden);
- proposer.py: how they draft (depth d from its frontier's paths);
- training.py: the modules of recipe kinds "hydra" and "hydra_pp";
- formats.py: the authors' Hydra files (arch mlp or prefix-mlp).
"""
from models.methods.hydra.family import Hydra, HydraPP
from models.methods.hydra.formats import HYDRA_FORMAT
from models.methods.hydra.proposer import HydraProposer
from models.methods.hydra.training import HydraModule, HydraPPModule
from models.shared.method import Method, RecipeKind

HYDRA = Method(name="hydra", family=Hydra(), proposer=HydraProposer, recipes=(RecipeKind("hydra", HydraModule),),
               formats=(HYDRA_FORMAT,))
HYDRA_PP = Method(name="hydra_pp", family=HydraPP(), proposer=HydraProposer,
                  recipes=(RecipeKind("hydra_pp", HydraPPModule),), formats=(HYDRA_FORMAT,))
