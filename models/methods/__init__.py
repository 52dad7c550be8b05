"""The drafting methods, one package each, listed here: METHODS is the one place a method is named, and every caller
looks methods up through this module. Nothing registers itself on import.

    medusa/        Medusa-1 and Medusa-2 (one family, two recipe kinds; the joint LoRA stage)
    hydra/         Hydra and Hydra++ (its prefix layer: HydraPPHeads)
    eagle/         EAGLE-1 and EAGLE-3 (their layers, families and formats)
    draft_model/   a small draft model (SpS)
    dflash/        DFlash, a block drafted in one forward, and DSpark, its block with a Markov and a confidence head

A method's package holds its family (what its module is: a HeadFamily and, when it owns more than heads, a DraftHeads
subclass), its proposer, its training modules and recipe types, its formats and taps, and declares them in a Method
(models/shared/method.py). Adding one is its package and one entry in METHODS (README.md#adding-a-method).

    method("hydra_pp").family                 # a config's `family` -> its Method
    recipe_kind("medusa2").module             # a recipe kind -> the LightningModule that trains it
    make_recipe({"kind": "eagle3", "unroll": 3, ...})                   # -> the kind's checked recipe dataclass
    new_recipe(kind="medusa2", medusa_lambda=0.2)                       # the same from keywords
    heads = build_heads(config, base, draft_ids);  base, heads = load_heads("results/heads/hydra", base)
    base, heads, adapted = load_for_decoding("results/heads/medusa2", base, keep_base=True)    # LoRA merged, packed
    export_heads(heads, base, "out/medusa1-vllm", fmt="vllm");  import_heads(folder, base, fmt="eagle3")
"""
from __future__ import annotations

import copy
from pathlib import Path

from models.engine.fast_inference import prepare_heads_for_decoding
from models.engine.path_choice import prepare_for_decoding
from models.methods.dflash import DFLASH, DSPARK, DSPARK_GATED, DSPARK_RNN
from models.methods.draft_model import DRAFT_MODEL
from models.methods.eagle import EAGLE, EAGLE3
from models.methods.hydra import HYDRA, HYDRA_PP
from models.methods.medusa import MEDUSA
from models.shared import draft_heads, formats
from models.shared.draft_heads import ADAPTER_DIR, DraftHeads, HeadsConfig
from models.shared.method import Method, RecipeKind
from models.shared.recipes import Recipe, checked_recipe

# in the order tables and listings give them (formats: medusa, vllm, hydra, eagle, eagle3, speculators)
METHODS: tuple[Method, ...] = (MEDUSA, HYDRA, HYDRA_PP, EAGLE, EAGLE3, DRAFT_MODEL, DFLASH, DSPARK, DSPARK_GATED,
                               DSPARK_RNN)


def method(name: str) -> Method:
    """The method whose family is `name` (a heads config's `family`)."""
    for m in METHODS:
        if m.name == name:
            return m
    raise ValueError(f"heads family {name!r} is not known; use one of {sorted(m.name for m in METHODS)} (a new method is "
                     "a package under models/methods/ and an entry in models.methods.METHODS)")


def recipe_kind(kind: str) -> RecipeKind:
    """The recipe kind `kind` (a config's recipe.kind), from the method that lists it."""
    for m in METHODS:
        for r in m.recipes:
            if r.kind == kind:
                return r
    raise ValueError(f"recipe kind {kind!r} is not known; use one of {sorted(recipe_kinds())}")


def recipe_kinds() -> tuple[str, ...]:
    """Every recipe kind once (the DSpark methods share theirs)."""
    return tuple(dict.fromkeys(r.kind for m in METHODS for r in m.recipes))


def make_recipe(values: dict, ignore: tuple[str, ...] = ()) -> Recipe:
    """The recipe of values["kind"] from a config's recipe mapping, as its kind's dataclass; keys in `ignore` belong
    to the stage, not the recipe. An unknown kind or field is an error naming what is accepted."""
    values = {k: v for k, v in values.items() if k not in ignore}
    return checked_recipe(recipe_kind(values.get("kind")).recipe_type, values)


def new_recipe(**fields) -> Recipe:
    """make_recipe(fields): new_recipe(kind="medusa2", medusa_lambda=0.2) -> a Medusa2Recipe."""
    return make_recipe(fields)


def build_heads(config: HeadsConfig, base_model, draft_ids=None) -> DraftHeads:
    """Fresh heads of the method config.family names, on base_model."""
    return draft_heads.build_heads(config, method(config.family), base_model, draft_ids)


def load_heads(folder: str | Path, base_model):
    """(base model, heads) from a heads folder (a Medusa-2 LoRA adapter saved with them merged into the base)."""
    return draft_heads.load_heads(folder, base_model, method)


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


def known_formats() -> dict[str, formats.Format]:
    """Every method's formats by name, in METHODS' order (a format two methods list: one, holding both; formats.by_name)."""
    return formats.by_name(f for m in METHODS for f in m.formats)


def export_heads(heads: DraftHeads, base_model, folder: str | Path, fmt: str, has_adapter: bool = False) -> dict:
    """Write `heads` to `folder` in format `fmt` (models/shared/formats.py export_heads)."""
    return formats.export_heads(heads, base_model, folder, fmt, known_formats(), has_adapter)


def import_heads(folder: str | Path, base_model, fmt: str) -> DraftHeads:
    """Heads read from `folder` in format `fmt`."""
    return formats.import_heads(folder, base_model, fmt, known_formats(), build_heads)
