"""The draft model's family and heads module (`heads.draft_model`: its DraftModel, built from the base on the first
attach) and its recipe kind "draft_model"
(distilled with models/shared/autoregressive/training.py, an AutoregressiveRecipe).

    heads = build_heads(HeadsConfig.for_base(model, family="draft_model", num_heads=5, num_layers=2), model)
    heads.draft_model is heads.draft_module   # a DraftModel; heads.draft_model.to_causal_lm(model): sps_hf's assistant
"""
from __future__ import annotations

from torch import nn

from models.shared.autoregressive.heads import AutoregressiveFamily, AutoregressiveHeads
from models.shared.autoregressive.training import AutoregressiveFitModule
from models.shared.families import register_family
from models.shared.recipes import AutoregressiveRecipe
from models.shared.training import register_recipe
from models.methods.draft_model.draft_model import DraftModel


class DraftModelHeads(AutoregressiveHeads):
    """The heads' LM head (the base's, shared, or its own) over a DraftModel's outputs."""

    def __init__(self, config, base_model=None, draft_ids=None):
        super().__init__(config, draft_ids=draft_ids)
        self.draft_model: DraftModel | None = None     # built by the first attach
        if base_model is not None:
            self.attach(base_model, init_from_base=True)

    def build_parts(self, base_model) -> None:
        if self.draft_model is None:
            self.draft_model = DraftModel.from_base(base_model, num_layers=self.config.num_layers).train(self.training)

    @property
    def draft_module(self) -> nn.Module:
        return self.draft_model


@register_family
class DraftModelFamily(AutoregressiveFamily):
    """A small draft model (models/methods/draft_model/draft_model.py): num_layers decoder layers over the tokens
    alone."""
    name = "draft_model"
    recipes = ("draft_model",)
    heads_class = DraftModelHeads


register_recipe("draft_model", AutoregressiveRecipe)(AutoregressiveFitModule)
