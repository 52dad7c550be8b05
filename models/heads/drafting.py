"""The head methods' proposers, registered with the engine: import this module where heads decode (the engine
asks registered factories for a proposer and never imports a method; training does not need them). EAGLE,
EAGLE-3, the draft model and their subclasses draft with AutoregressiveProposer; Medusa, Hydra, Hydra++ and
theirs with HeadsProposer.

    import models.heads.drafting  # noqa: F401
    drafter = heads_drafter(heads, tree)
    model, heads, adapted = load_for_decoding("results/heads/medusa2", base, keep_base=True)   # LoRA merged, packed
"""
from __future__ import annotations

import copy
from pathlib import Path

from models.engine.drafters.proposer import register_proposer
from models.engine.fast_inference import prepare_for_decoding, prepare_heads_for_decoding
from models.heads.draft_heads import ADAPTER_DIR, load_heads
from models.heads.autoregressive_proposer import AutoregressiveProposer
from models.heads.families import FAMILIES, AutoregressiveFamily, Hydra, Medusa
from models.heads.proposers import HeadsProposer


@register_proposer
def family_proposer(heads):
    """The proposer of heads of these families or their subclasses; None for others (a family of another
    lineage registers its own proposer)."""
    family = FAMILIES.get(getattr(getattr(heads, "config", None), "family", None))
    if isinstance(family, AutoregressiveFamily):
        return AutoregressiveProposer(heads=heads)
    if isinstance(family, (Medusa, Hydra)):
        return HeadsProposer(heads)
    return None


def load_for_decoding(folder: str | Path, base, keep_base: bool = False, bf16_heads: bool | None = None):
    """Trained heads from `folder` attached to `base`, a LoRA adapter saved with them (Medusa-2) merged into the
    backbone, and both packed for decoding (models/engine/fast_inference.py) -> (model, heads, adapted).
    keep_base: merge into a copy, so that the caller can still decode the unchanged base (its baseline);
    bf16_heads: prepare_heads_for_decoding's choice (None: its default)."""
    adapted = (Path(folder) / ADAPTER_DIR).is_dir()
    model, heads = load_heads(folder, copy.deepcopy(base) if adapted and keep_base else base)
    prepare_for_decoding(model)                   # after the merge: the fast paths run on the final weights
    prepare_heads_for_decoding(heads, bf16=bf16_heads)
    return model, heads, adapted
