"""Trained heads made ready to decode: loaded, a LoRA adapter saved with them merged, both packed. The proposers come
from the methods' packages (models/methods/), registered with the engine when they are imported; any heads built
through their family have imported them.

    model, heads, adapted = load_for_decoding("results/heads/medusa2", base, keep_base=True)   # LoRA merged, packed
    drafter = make_drafter({"kind": "heads", "tree": spec}, heads=heads)
"""
from __future__ import annotations

import copy
from pathlib import Path

from models.engine.fast_inference import prepare_for_decoding, prepare_heads_for_decoding
from models.shared.draft_heads import ADAPTER_DIR, load_heads


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
