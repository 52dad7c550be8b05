"""The one place a method's training recipe is resolved: conf/heads/<name>.yaml's `recipe`, the profile's changes
to it (profile.train.heads_overrides.<name>, profile.train.max_warmup_ratio, the epochs rule, Medusa-2's
lm_loss: auto), checked against the family; what came from where goes beside the trained heads (recipe.json)
and into the train stage's MLflow run.

    cfg = with_profile_heads(cfg)                      # the profile's heads_overrides merged into cfg.heads
    recipe = trainable_recipe(cfg)                       # a typed Recipe (models/shared/recipes.py)
    record = recipe_record(cfg, recipe)                # {"recipe", "epochs", "profile_overrides", ...}
"""
from __future__ import annotations

import dataclasses

from omegaconf import DictConfig, OmegaConf, open_dict

from models.methods import make_recipe as recipe_of, method
from models.shared.recipes import Recipe
from pipelines.common import heads_options

# Recipe keys the stage reads itself (the rest configure models.shared.recipes.Recipe).
STAGE_KEYS = ("epochs", "stage1_fraction", "lora")


def profile_overrides(cfg: DictConfig) -> dict:
    """What profile.train.heads_overrides sets for these heads ({} when nothing)."""
    mine = (cfg.profile.train.get("heads_overrides") or {}).get(cfg.heads.name)
    return OmegaConf.to_container(mine, resolve=True) if mine else {}


def with_profile_heads(cfg: DictConfig) -> DictConfig:
    """cfg with profile.train.heads_overrides[<heads name>] merged into cfg.heads: what a profile changes of a
    published recipe, by the rules every method gets alike (cpu: the learning-rate rule, docs/protocol.md's recipe
    table), conf/heads/<name>.yaml left as published."""
    overrides = cfg.profile.train.get("heads_overrides") or {}
    unknown = sorted(set(overrides) - set(heads_options()))
    if unknown:
        raise ValueError(f"profile.train.heads_overrides names {unknown}: not head configs; use {heads_options()}")
    mine = profile_overrides(cfg)
    if not mine:
        return cfg
    extra = sorted(set(mine) - set(cfg.heads))
    if extra:
        raise ValueError(f"profile.train.heads_overrides.{cfg.heads.name} sets {extra}: not keys of "
                         f"conf/heads/{cfg.heads.name}.yaml; it takes {sorted(cfg.heads)}")
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.heads = OmegaConf.merge(cfg.heads, mine)
    return cfg


def stage_heads(cfg: DictConfig, name: str) -> DictConfig:
    """cfg with conf/heads/<name>.yaml as its heads (resolved against cfg) and the profile's overrides merged: the
    heads as the stage of that name runs them."""
    from pipelines.common import conf_option

    other = cfg.copy()
    with open_dict(other):
        other.heads = conf_option("heads", str(name))
    return with_profile_heads(other)


def effective_epochs(cfg: DictConfig) -> int:
    """The recipe's epochs when it has its own (Hydra++: 10), else the profile's; capped by profile.train.max_epochs:
    one number for every family, or a mapping from heads name to cap with a `default` (null: no cap)."""
    epochs = cfg.heads.recipe.get("epochs") or cfg.profile.train.epochs
    cap = cfg.profile.train.get("max_epochs")
    if isinstance(cap, DictConfig):
        if "default" not in cap:
            raise ValueError(f"profile.train.max_epochs={OmegaConf.to_container(cap)}: a mapping needs a `default` "
                             "entry (the cap of the heads it does not name)")
        cap = cap.get(cfg.heads.name, cap.default)
    return int(min(epochs, cap) if cap else epochs)


def make_recipe(cfg: DictConfig) -> Recipe:
    d = OmegaConf.to_container(cfg.heads.recipe, resolve=True)
    d.setdefault("max_warmup_ratio", cfg.profile.train.get("max_warmup_ratio"))
    if d.get("lm_loss") == "auto":  # Medusa-2: KL to the adapters-off model only on the model's own answers
        d["lm_loss"] = "kl" if cfg.profile.train.get("data", "distilled") == "distilled" else "ce"
    return recipe_of(d, ignore=STAGE_KEYS)


def trainable_recipe(cfg: DictConfig) -> Recipe:
    """The heads' recipe, refused with the reason when the family cannot be trained with it."""
    h = cfg.heads
    if h.family == "none":
        raise ValueError(f"heads=none has nothing to train; use heads=<one of {heads_options()}>")
    recipe = make_recipe(cfg)
    kinds = method(h.family).recipe_kinds
    if recipe.kind not in kinds:
        raise ValueError(f"heads {h.name}: recipe kind {recipe.kind!r} does not train the {h.family!r} family; "
                         f"it takes {list(kinds)}")
    return recipe


def recipe_record(cfg: DictConfig, recipe: Recipe) -> dict:
    """What the heads were trained with, resolved, and where it came from (written as recipe.json beside them)."""
    stage = {k: OmegaConf.to_container(cfg.heads.recipe, resolve=True).get(k) for k in STAGE_KEYS}
    return {"heads": cfg.heads.name, "family": cfg.heads.family, "profile": cfg.profile.name,
            "recipe_type": type(recipe).__name__, "recipe": dataclasses.asdict(recipe), "epochs": effective_epochs(cfg),
            "stage": stage, "dropout": float(cfg.heads.dropout), "profile_overrides": profile_overrides(cfg)}
