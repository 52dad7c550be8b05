"""Training recipes, typed: the knobs every method's training has (Recipe), and one dataclass per method that has
more (Medusa-2's joint stage: models/methods/medusa/training.py Medusa2Recipe; the autoregressive drafters' unrolled
training, shared by EAGLE, EAGLE-3 and the draft model: models/shared/autoregressive/training.py AutoregressiveRecipe).
A recipe is checked when it is made, and an error names the field, its value and what is accepted.

    recipe = Recipe(kind="hydra", lr=1e-3)                          # the base type's fields only
    recipe = models.methods.make_recipe({"kind": "medusa2", "medusa_lambda": 0.2})   # -> Medusa2Recipe: the kind's type
    models.methods.make_recipe({"kind": "medusa1", "unroll": 2})    # ValueError: medusa1 takes no unroll; it takes ...
    heads_only = recast(recipe, Recipe, "medusa1", lr=1e-3)         # the fields the other type shares, changed where given

A kind's type is its training module's `recipe_type` (models/shared/training.py HeadsModule), found through the
method that lists the kind (models/methods/__init__.py); the loss terms every recipe has (lm_loss_weight: CE against
the data's token; teacher_loss_weight: soft CE against the frozen base's distribution) are the same for every method.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields


def check_field(kind: str, name: str, value, ok: bool, accepted: str) -> None:
    if not ok:
        raise ValueError(f"recipe {kind!r}: {name}={value!r} is not accepted; {name} takes {accepted}")


@dataclass
class Recipe:
    """What every method's training sets; a kind with more fields has its own subclass (see the module docstring)."""
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

    def __post_init__(self):
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


def fields_of(recipe_type: type[Recipe]) -> set[str]:
    return {f.name for f in fields(recipe_type)}


def checked_recipe(recipe_type: type[Recipe], values: dict) -> Recipe:
    """recipe_type(**values), an unknown field refused with the fields the type takes."""
    known = fields_of(recipe_type)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"recipe {values.get('kind')!r} ({recipe_type.__name__}) takes no {', '.join(unknown)}; it "
                         f"takes {', '.join(sorted(known))}")
    return recipe_type(**values)


def recast(recipe: Recipe, recipe_type: type[Recipe], kind: str, **changes) -> Recipe:
    """`recipe` as another kind of type recipe_type: the fields that type has, from here, with `changes` on top."""
    known = fields_of(recipe_type)
    return checked_recipe(recipe_type, {**{k: v for k, v in asdict(recipe).items() if k in known}, **changes,
                                        "kind": kind})
