"""Medusa's family (Medusa-1 and Medusa-2 share it: the heads are the same, the recipes differ): K heads independent
per depth, each a stack of ResBlocks on h_t (the shared base's behaviour, models/shared/families.py HeadFamily), drafted
by the per-depth heads' proposer (models/shared/heads_proposer.py; its own: proposer.py).
"""
from __future__ import annotations

from models.shared.families import HeadFamily


class Medusa(HeadFamily):
    name = "medusa"
    window_recipes = ("medusa1",)
