"""A bare EagleModule (no heads module) drafting on a tree, scored by the base LM head over the full vocabulary with
the model's logit transform: what the authors' EAGLE-1 code drafts (conformance with it, tests). Trained EAGLE heads
draft through their Method's proposer (make_drafter({"kind": "heads", ...}, heads=heads)).

    drafter = EagleDrafter(EagleModule.from_base(model, seed=0), spec)
"""
from __future__ import annotations

import torch

from models.engine.drafters.tree import TreeDrafter
from models.engine.trees import TreeBuffers, TreeSpec
from models.shared.autoregressive.proposer import AutoregressiveProposer


class EagleDrafter(TreeDrafter):
    """A bare EagleModule (no DraftHeads) on a tree: the base LM head over the full vocabulary (conformance with
    the official code, tests). cache and feature are its proposer's."""

    def __init__(self, eagle, tree: TreeSpec | TreeBuffers, want_probs: bool = False,
                 step_cost: list[float] | None = None):
        super().__init__(None, tree, step_cost, want_probs, proposer=AutoregressiveProposer(module=eagle))

    @property
    def cache(self):
        return self.proposer.cache

    @property
    def feature(self) -> torch.Tensor:
        return self.proposer.feature
