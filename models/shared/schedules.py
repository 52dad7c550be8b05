"""What a recipe trains, stage by stage: one fit for the frozen-backbone families, two for Medusa-2 (the heads
alone on the frozen base, then LoRA adapters on the backbone together with the heads; docs/reference.md#training-recipes).

    trains = models.methods.recipe_kind(recipe.kind).module            # the recipe kind's LightningModule
    for plan in plan_stages(trains, recipe, epochs=3, stage1_fraction=0.67, lora={"r": 32, "alpha": 16, "dropout": 0.05}):
        module = plan.module(heads, model)      # plan.name, plan.epochs, plan.loader_kind, plan.limit, plan.val_every
"""
from __future__ import annotations

from dataclasses import dataclass

from models.shared.recipes import Recipe, recast
from models.shared.training import HeadsModule


@dataclass
class StagePlan:
    name: str                        # "fit"; a two-stage recipe: "stage1", "stage2"
    trains: type[HeadsModule]        # the LightningModule of this stage
    recipe: Recipe
    epochs: int
    loader_kind: str                 # the recipe kind its training batches are made for
    limit: int | None = None         # at most this many training conversations
    val_every: int | None = None     # validate every n steps (the joint stage's curve)
    lora: dict | None = None         # the backbone trained through LoRA adapters with these settings (r, alpha, dropout)

    def module(self, heads, model):
        """The LightningModule of this stage (heads-only stages on the frozen model, a joint stage on a LoRA copy)."""
        cls = self.trains
        if self.lora is not None:
            from peft import LoraConfig, get_peft_model

            config = LoraConfig(r=int(self.lora["r"]), lora_alpha=int(self.lora["alpha"]),
                                lora_dropout=float(self.lora["dropout"]), target_modules="all-linear",
                                task_type="CAUSAL_LM")
            return cls(heads, get_peft_model(model, config), self.recipe)
        return cls(heads, model, self.recipe, log_prefix="" if self.name == "fit" else f"{self.name}/")


def plan_stages(module: type[HeadsModule], recipe: Recipe, epochs: int, stage1_fraction: float = 0.0,
                lora: dict | None = None, joint_limit: int | None = None,
                joint_val_every: int | None = None) -> list[StagePlan]:
    """The stages of `recipe`, trained by `module` (its kind's LightningModule), over `epochs`. A module that trains
    the backbone (joint_backbone) runs round(stage1_fraction * epochs) heads-only epochs first (as its
    heads_only_kind, with its heads_only_module), at the heads' learning rate, then the rest jointly."""
    if not module.joint_backbone:
        return [StagePlan("fit", module, recipe, epochs, recipe.kind)]
    if lora is None:
        raise ValueError(f"recipe {recipe.kind!r} trains the backbone through LoRA: give its lora settings "
                         "(r, alpha, dropout)")
    stage1 = max(1, round(stage1_fraction * epochs)) if stage1_fraction > 0 else 0
    plans = []
    if stage1:
        first = module.heads_only_module
        heads_only = recast(recipe, first.recipe_type, module.heads_only_kind, lr=recipe.lr * recipe.head_lr_multiplier)
        plans.append(StagePlan("stage1", first, heads_only, stage1, module.heads_only_kind))
    plans.append(StagePlan("stage2", module, recipe, max(1, epochs - stage1), recipe.kind, joint_limit, joint_val_every,
                           lora))
    return plans
