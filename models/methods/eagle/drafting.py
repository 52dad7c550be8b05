"""How EAGLE-1 and EAGLE-3 draft, registered with the engine (imported by models/methods/drafting.py where heads
decode): their heads' proposer, the autoregressive one (models/shared/autoregressive/proposer.py), and the "eagle"
drafter kind: a bare EagleModule (no heads module) on a tree, scored by the base LM head over the full vocabulary with
the model's logit transform (conformance with the authors' code, tests).

    drafter = make_drafter({"kind": "heads", "tree": spec}, heads=eagle_heads)
    drafter = make_drafter({"kind": "eagle", "tree": spec}, eagle=EagleModule.from_base(model, seed=0))
"""
from __future__ import annotations

import torch

from models.engine.drafters.base import register_drafter
from models.engine.drafters.proposer import register_proposer
from models.engine.drafters.tree import TreeDrafter
from models.engine.trees import TreeBuffers, TreeSpec
from models.shared.autoregressive.proposer import AutoregressiveProposer
from models.shared.families import family_of
from models.methods.eagle.family import Eagle, Eagle3


class EagleDrafter(TreeDrafter):
    """A bare EagleModule (no DraftHeads) on a tree: the base LM head over the full vocabulary (conformance with
    the official code, tests). cache and feature are its proposer's."""

    def __init__(self, eagle, tree: TreeSpec | TreeBuffers, want_probs: bool = False,
                 step_cost: list[float] | None = None):
        super().__init__(None, tree, step_cost, want_probs, proposer=AutoregressiveProposer(eagle=eagle))

    @property
    def cache(self):
        return self.proposer.cache

    @property
    def feature(self) -> torch.Tensor:
        return self.proposer.feature


@register_drafter("eagle")
def build_eagle(spec: dict, eagle=None, **_) -> EagleDrafter:
    """spec: tree (TreeSpec or TreeBuffers), want_probs, step_cost (optional); eagle: models.methods.eagle.eagle.EagleModule."""
    missing = [what for what, have in (("eagle=EagleModule(...)", eagle is not None),
                                       ("a tree in its spec", spec.get("tree") is not None)) if not have]
    if missing:
        raise ValueError(f"an eagle drafter needs {' and '.join(missing)}")
    return EagleDrafter(eagle, spec["tree"], bool(spec.get("want_probs", False)), spec.get("step_cost"))


@register_proposer
def eagle_proposer(heads):
    """The proposer of EAGLE-1 and EAGLE-3 heads (and their subclasses' families); None for others."""
    return AutoregressiveProposer(heads=heads) if isinstance(family_of(heads), (Eagle, Eagle3)) else None
