"""The draft model's family: its DraftModel held as `heads.draft_model` in the shared autoregressive heads module,
built from the base on the first attach, distilled and drafted on EAGLE's code paths (models/shared/autoregressive/).

    heads = models.methods.build_heads(HeadsConfig.for_base(model, family="draft_model", num_heads=5, num_layers=2),
                                       model)
    heads.draft_model is heads.draft_module   # a DraftModel; heads.draft_model.to_causal_lm(model): sps_hf's assistant
"""
from __future__ import annotations

from models.methods.draft_model.draft_model import DraftModel
from models.shared.autoregressive.heads import AutoregressiveFamily


class DraftModelFamily(AutoregressiveFamily):
    """A small draft model (models/methods/draft_model/draft_model.py): num_layers decoder layers over the tokens
    alone."""
    name = "draft_model"
    draft_attr = "draft_model"
    assistant = True

    def build_draft(self, base_model, config) -> DraftModel:
        return DraftModel.from_base(base_model, num_layers=config.num_layers)
