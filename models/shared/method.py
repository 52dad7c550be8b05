"""What a drafting method is, declared once in its own package (models/methods/<method>/) and listed explicitly in
models/methods/__init__.py: a frozen contract the shared code and the engine read, never a registry filled on import.

    HYDRA = Method(name="hydra", family=Hydra(), proposer=HydraProposer,
                   recipes=(RecipeKind("hydra", HydraModule),), formats=(HYDRA_FORMAT,))
    heads.method.proposer(heads)         # how the engine drafts with heads it is handed (no method imported)
    heads.family.taps(base.config)       # what its module is: the base states it reads, its blocks, its heads class

A Method's name is the `family` a heads config names (conf/heads/<name>.yaml; heads_config.json); its recipe kinds
are the `recipe.kind` values that config may take.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from models.shared.families import HeadFamily
from models.shared.formats import Format


@dataclass(frozen=True)
class RecipeKind:
    """A recipe kind: the LightningModule that trains it (models/shared/training.py HeadsModule); the recipe's
    dataclass is the module's `recipe_type`."""
    kind: str
    module: type

    @property
    def recipe_type(self) -> type:
        return self.module.recipe_type


@dataclass(frozen=True)
class Method:
    """One drafting method: its name (the family configs name), its family (what its module is: the heads class, the
    blocks, the base states it taps, the capabilities shared code asks for), its proposer factory (heads -> a Proposer
    for the engine), its recipe kinds and the formats other code loads its files in."""
    name: str
    family: HeadFamily
    proposer: Callable
    recipes: tuple[RecipeKind, ...]
    formats: tuple[Format, ...] = ()

    def __post_init__(self):
        if not self.name or not self.recipes:
            raise ValueError(f"method {self.name!r} needs a name and at least one recipe kind")
        if self.family.name != self.name:
            raise ValueError(f"method {self.name!r} has the family {self.family.name!r}: they must be the same name")

    @property
    def recipe_kinds(self) -> tuple[str, ...]:
        return tuple(r.kind for r in self.recipes)
