"""Training recipes, typed: the knobs every method's training has (Recipe), and one dataclass per method that has
more (Medusa-2's joint stage: models/methods/medusa/training.py Medusa2Recipe; the autoregressive drafters' unrolled
training, shared by EAGLE, EAGLE-3 and the draft model: AutoregressiveRecipe here). A recipe is checked when it is
made, and an error names the field, its value and what is accepted.

    recipe = Recipe(kind="hydra", lr=1e-3)                 # -> Recipe: the kind's own type (register_recipe)
    recipe = Recipe(kind="medusa2", medusa_lambda=0.2)     # -> Medusa2Recipe
    recipe = Recipe.from_dict({"kind": "eagle3", "unroll": 3, ...})                       # a config's recipe
    Recipe(kind="medusa1", unroll=2)                       # ValueError: medusa1 takes no unroll; it takes ...
    heads_only = recipe.as_kind("medusa1", lr=1e-3)        # the fields the other kind shares, changed where given

The kinds register their type with their LightningModule in their method's package (models/shared/training.py
register_recipe); the loss
terms every recipe has (lm_loss_weight: CE against the data's token; teacher_loss_weight: soft CE against the
frozen base's distribution) are the same for every method.
"""
from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass, fields

RECIPE_TYPES: dict[str, type["Recipe"]] = {}        # recipe kind -> its dataclass
# the package whose methods register their recipe kinds (a Recipe of a kind not yet seen imports it)
RECIPE_MODULES = ("models.methods",)


def recipe_type(kind) -> type["Recipe"]:
    """The dataclass of recipe `kind`."""
    if kind not in RECIPE_TYPES:
        for module in RECIPE_MODULES:
            importlib.import_module(module)
    if kind not in RECIPE_TYPES:
        raise ValueError(f"recipe kind {kind!r} is not known; use one of {sorted(RECIPE_TYPES)}")
    return RECIPE_TYPES[kind]


def check_field(kind: str, name: str, value, ok: bool, accepted: str) -> None:
    if not ok:
        raise ValueError(f"recipe {kind!r}: {name}={value!r} is not accepted; {name} takes {accepted}")


@dataclass
class Recipe:
    """What every method's training sets. Recipe(kind=...) makes the kind's own type (see the module docstring)."""
    kind: str
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_ratio: float = 0.1
    warmup_steps: int | None = None     # wins over warmup_ratio when set
    max_warmup_ratio: float | None = None   # cap on the warm-up share (small runs: 100 steps may be most of them)
    min_lr_ratio: float = 0.0           # cosine decays to lr * min_lr_ratio
    head_decay: float = 0.8             # head k weighted head_decay^(k + head_decay_offset)
    head_decay_offset: int = 0          # Medusa-2's trainer: 1 (0.8^(k+1), k from 0)
    lm_loss_weight: float = 1.0         # CE against the data's token
    teacher_loss_weight: float = 0.0    # soft CE against the frozen base's distribution

    def __new__(cls, *args, **kwargs):
        # Recipe(kind=...) builds the kind's registered type; every type refuses fields it does not have
        kind = kwargs.get("kind", args[0] if args else None)
        if kind is None and not args:           # copy and pickle make the object first, then set its fields
            return super().__new__(cls)
        if cls is Recipe:
            cls = recipe_type(kind)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"recipe {kind!r} ({cls.__name__}) takes no {', '.join(unknown)}; it takes "
                             f"{', '.join(sorted(known))}")
        return super().__new__(cls)

    def __post_init__(self):
        want = recipe_type(self.kind)
        if not isinstance(self, want):
            raise ValueError(f"recipe kind {self.kind!r} is a {want.__name__}, not a {type(self).__name__}")
        k = self.kind
        check_field(k, "lr", self.lr, self.lr > 0, "a positive number")
        check_field(k, "weight_decay", self.weight_decay, self.weight_decay >= 0, "a number >= 0")
        check_field(k, "warmup_ratio", self.warmup_ratio, 0 <= self.warmup_ratio <= 1, "a number in [0, 1]")
        check_field(k, "warmup_steps", self.warmup_steps, self.warmup_steps is None or self.warmup_steps >= 0,
               "null or a whole number >= 0")
        check_field(k, "max_warmup_ratio", self.max_warmup_ratio,
               self.max_warmup_ratio is None or 0 <= self.max_warmup_ratio <= 1, "null or a number in [0, 1]")
        check_field(k, "min_lr_ratio", self.min_lr_ratio, 0 <= self.min_lr_ratio <= 1, "a number in [0, 1]")
        check_field(k, "head_decay", self.head_decay, self.head_decay > 0, "a positive number")
        for name in ("lm_loss_weight", "teacher_loss_weight"):
            check_field(k, name, getattr(self, name), getattr(self, name) >= 0, "a number >= 0")

    def head_weight(self, k: int) -> float:
        """Weight of head k's loss (k from 0): head_decay^(k + head_decay_offset)."""
        return self.head_decay ** (k + self.head_decay_offset)

    @classmethod
    def from_dict(cls, d: dict, ignore: tuple[str, ...] = ()) -> "Recipe":
        """A config's recipe (conf/heads/<name>.yaml `recipe`); keys in `ignore` belong to the stage, not here."""
        return Recipe(**{k: v for k, v in d.items() if k not in ignore})

    def as_kind(self, kind: str, **changes) -> "Recipe":
        """This recipe as another kind: the fields that kind has, from here, with `changes` on top."""
        known = {f.name for f in fields(recipe_type(kind))}
        return Recipe(**{**{k: v for k, v in asdict(self).items() if k in known}, **changes, "kind": kind})


@dataclass
class AutoregressiveRecipe(Recipe):
    """EAGLE, EAGLE-3 and a draft model: one module unrolled over its own predictions."""
    feature_loss_weight: float = 0.0    # SmoothL1 of the predicted feature to the base's
    feature_noise: float = 0.0          # width of the uniform noise on the input features while training
    noise_reference_length: int | None = None   # set: a row of T tokens gets width feature_noise * this / T
    unroll: int = 1                     # depths trained (>1: each on the draft's own predicted features)
    draft_vocab_mask: bool = False      # positions whose label lies outside the draft vocabulary carry no loss

    def __post_init__(self):
        super().__post_init__()
        k = self.kind
        check_field(k, "feature_loss_weight", self.feature_loss_weight, self.feature_loss_weight >= 0, "a number >= 0")
        check_field(k, "feature_noise", self.feature_noise, self.feature_noise >= 0, "a number >= 0")
        ref = self.noise_reference_length
        check_field(k, "noise_reference_length", ref, ref is None or (isinstance(ref, int) and not isinstance(ref, bool)
               and ref >= 1), "null (a fixed width) or a whole number >= 1 (EAGLE's trainer: 512)")
        check_field(k, "unroll", self.unroll, isinstance(self.unroll, int) and self.unroll >= 1,
               "a whole number >= 1 (the depths trained)")

    def noise_width(self, length):
        """The input-noise width of a row of `length` tokens (an int, or a tensor of one per row): feature_noise,
        times noise_reference_length / length when that is set, as EAGLE's trainer scales it (512 / T)."""
        if self.noise_reference_length is None:
            return self.feature_noise
        return self.feature_noise * self.noise_reference_length / length
