"""Medusa's family (Medusa-1 and Medusa-2 share it: the heads are the same, the recipes differ): K heads independent
per depth, each a stack of ResBlocks on h_t (the shared base's behaviour, models/shared/families.py HeadFamily), drafted
by the per-depth heads' proposer (registered by drafting.py).
"""
from __future__ import annotations

from models.shared.families import HeadFamily, register_family


@register_family
class Medusa(HeadFamily):
    name = "medusa"
    recipes = ("medusa1", "medusa2")
    window_recipes = ("medusa1",)
