"""Medusa-1's and Medusa-2's training (docs/reference.md#training-recipes): the modules of recipe kinds "medusa1"
(independent heads on h_t, frozen backbone) and "medusa2" (stage 2: LoRA adapters on the backbone trained jointly with
the heads; its first, heads-only stage trains as medusa1: models/shared/schedules.py), and Medusa2Recipe, the joint
stage's own fields.

    module = Medusa2Module(heads, get_peft_model(model, lora), Medusa2Recipe(kind="medusa2", medusa_lambda=0.2))
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.methods.medusa.joint_stage import JointCurve, backbone_drift
from models.shared.recipes import Recipe, check_field
from models.shared.training import IGNORE_INDEX, HeadsModule, kl_to_reference


@dataclass
class Medusa2Recipe(Recipe):
    """Medusa-2: the backbone trained jointly through LoRA adapters."""
    head_lr_multiplier: float = 1.0     # heads lr = lr * this
    medusa_lambda: float = 0.2          # weight of the heads' loss
    lambda_schedule: str = "sine"       # sine | constant
    lm_loss: str = "kl"                 # kl (to the adapters-off model) | ce (to the labels)

    def __post_init__(self):
        super().__post_init__()
        k = self.kind
        check_field(k, "head_lr_multiplier", self.head_lr_multiplier, self.head_lr_multiplier > 0, "a positive number")
        check_field(k, "medusa_lambda", self.medusa_lambda, self.medusa_lambda >= 0, "a number >= 0")
        check_field(k, "lambda_schedule", self.lambda_schedule, self.lambda_schedule in ("sine", "constant"),
               "sine or constant")
        check_field(k, "lm_loss", self.lm_loss, self.lm_loss in ("kl", "ce"), "kl (self-distilled data) or ce")


class Medusa1Module(HeadsModule):
    """Medusa-1: independent heads on h_t, frozen backbone."""


class Medusa2Module(HeadsModule):
    """Medusa-2 stage 2: LoRA backbone + heads. L = L_LM + lambda * s(t) * sum_k 0.8^(k+1) CE_k.

    `backbone` is a peft model over the base; L_LM is KL to the same model with the adapters
    switched off (self-distilled data: the base's own distribution is the target) or CE to the
    labels. The adapters-off hidden states come from the cache when the batch carries them.
    """

    recipe_type = Medusa2Recipe
    joint_backbone = True
    heads_only_kind, heads_only_module = "medusa1", Medusa1Module

    def __init__(self, heads, backbone, recipe: Recipe, log_prefix: str = ""):
        super().__init__(heads, backbone, recipe, log_prefix)
        self.backbone = backbone           # a submodule: Lightning moves and trains its LoRA weights
        self.strict_loading = False        # checkpoints hold the trainable weights only

    def trainable(self) -> torch.nn.Module:
        return self           # the heads and the LoRA backbone (its adapters' dropout)

    def stage_callbacks(self) -> list:
        return [JointCurve()]

    def after_fit(self, data: dict, device: str) -> dict:
        return backbone_drift(self, data, device)

    def on_save_checkpoint(self, checkpoint):
        super().on_save_checkpoint(checkpoint)
        trainable = {n for n, p in self.named_parameters() if p.requires_grad}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}

    def lambda_now(self) -> float:
        """lambda * s(t) while training (s: sine warm-up over all steps, or 1); lambda on validation."""
        r = self.recipe
        if r.lambda_schedule == "constant" or not self.training:
            return r.medusa_lambda
        return r.medusa_lambda * math.sin(min(1.0, self.global_step / self.total_steps) * math.pi / 2)

    def configure_optimizers(self):
        self.total_steps = max(1, int(self.trainer.estimated_stepping_batches))
        return super().configure_optimizers()

    def compute(self, batch):
        decoder, lm_head = self.backbone.get_base_model().get_decoder(), self.backbone.get_output_embeddings()
        hidden = decoder(input_ids=batch["input_ids"]).last_hidden_state         # right padding: no mask needed
        # L_LM at every position whose next token is an assistant token
        nxt = batch["labels"][:, 1:]
        b, p = (nxt != IGNORE_INDEX).nonzero(as_tuple=True)
        logits = lm_head(hidden[b, p])                                          # [N, V]
        if self.recipe.lm_loss == "kl":
            if "hidden" in batch:
                ref_hidden = batch["hidden"][b, p]
            else:
                with torch.no_grad(), self.backbone.disable_adapter():
                    ref_hidden = decoder(input_ids=batch["input_ids"]).last_hidden_state[b, p]
            with torch.no_grad():
                ref_logits = lm_head(ref_hidden.to(lm_head.weight.dtype))
            lm_loss = kl_to_reference(logits, ref_logits)
        else:
            lm_loss = F.cross_entropy(logits.float(), nxt[b, p])
        heads_loss, per_head = self.heads_loss(hidden, hidden, batch)
        lam = self.lambda_now()
        return lm_loss + lam * heads_loss, per_head, {"lm_loss": lm_loss.detach(), "lambda": lam}

    def param_groups(self):
        lora = [p for p in self.backbone.parameters() if p.requires_grad]
        heads = [p for p in self.heads.parameters() if p.requires_grad]
        return [{"params": lora, "lr": self.recipe.lr, "name": "lora"},
                {"params": heads, "lr": self.recipe.lr * self.recipe.head_lr_multiplier, "name": "heads"}]


