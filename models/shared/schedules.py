"""What a recipe trains, stage by stage: one fit for the frozen-backbone families, two for Medusa-2 (the heads
alone on the frozen base, then LoRA adapters on the backbone together with the heads; docs/reference.md#training-recipes).

    for plan in plan_stages(recipe, epochs=3, stage1_fraction=0.67, lora={"r": 32, "alpha": 16, "dropout": 0.05}):
        module = plan.module(heads, model)      # plan.name, plan.epochs, plan.loader_kind, plan.limit, plan.val_every
"""
from __future__ import annotations

from dataclasses import dataclass

from models.shared.training import Recipe, recipe_module


@dataclass
class StagePlan:
    name: str                        # "fit"; a two-stage recipe: "stage1", "stage2"
    recipe: Recipe
    epochs: int
    loader_kind: str                 # the recipe kind its training batches are made for
    limit: int | None = None         # at most this many training conversations
    val_every: int | None = None     # validate every n steps (the joint stage's curve)
    lora: dict | None = None         # the backbone trained through LoRA adapters with these settings (r, alpha, dropout)

    def module(self, heads, model):
        """The LightningModule of this stage (heads-only stages on the frozen model, a joint stage on a LoRA copy)."""
        cls = recipe_module(self.recipe.kind)
        if self.lora is not None:
            from peft import LoraConfig, get_peft_model

            config = LoraConfig(r=int(self.lora["r"]), lora_alpha=int(self.lora["alpha"]),
                                lora_dropout=float(self.lora["dropout"]), target_modules="all-linear",
                                task_type="CAUSAL_LM")
            return cls(heads, get_peft_model(model, config), self.recipe)
        return cls(heads, model, self.recipe, log_prefix="" if self.name == "fit" else f"{self.name}/")


def plan_stages(recipe: Recipe, epochs: int, stage1_fraction: float = 0.0, lora: dict | None = None,
                joint_limit: int | None = None, joint_val_every: int | None = None) -> list[StagePlan]:
    """The stages of `recipe` over `epochs`. A recipe whose module trains the backbone (joint_backbone) runs
    round(stage1_fraction * epochs) heads-only epochs first (as its module's heads_only_kind), at the heads' learning
    rate, then the rest jointly."""
    module = recipe_module(recipe.kind)
    if not module.joint_backbone:
        return [StagePlan("fit", recipe, epochs, recipe.kind)]
    if lora is None:
        raise ValueError(f"recipe {recipe.kind!r} trains the backbone through LoRA: give its lora settings "
                         "(r, alpha, dropout)")
    stage1 = max(1, round(stage1_fraction * epochs)) if stage1_fraction > 0 else 0
    plans = []
    if stage1:
        heads_only = recipe.as_kind(module.heads_only_kind, lr=recipe.lr * recipe.head_lr_multiplier)
        plans.append(StagePlan("stage1", heads_only, stage1, module.heads_only_kind))
    plans.append(StagePlan("stage2", recipe, max(1, epochs - stage1), recipe.kind, joint_limit, joint_val_every, lora))
    return plans
