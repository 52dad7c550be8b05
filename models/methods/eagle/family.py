"""EAGLE-1's and EAGLE-3's families and heads modules: each module holds its draft layer as its own declared attribute
(`eagle`, `eagle3`: the names its saved weights carry), built from the base on the first attach; they draft with the
autoregressive proposer (registered by drafting.py).

    heads = build_heads(HeadsConfig.for_base(model, family="eagle3", num_heads=5, draft_vocab_size=64), model, ids)
    heads.eagle3 is heads.draft_module        # an Eagle3Module; its LM head: heads.output_layer(0)
"""
from __future__ import annotations

from torch import nn

from models.engine.taps import eagle3_taps
from models.shared.autoregressive.heads import AutoregressiveFamily, AutoregressiveHeads
from models.shared.families import register_family
from models.methods.eagle.eagle import EagleModule
from models.methods.eagle.eagle3 import Eagle3Module


class EagleHeads(AutoregressiveHeads):
    """EAGLE-1: the heads' LM head over an EagleModule's predicted features."""

    def __init__(self, config, base_model=None, draft_ids=None):
        super().__init__(config, draft_ids=draft_ids)
        self.eagle: EagleModule | None = None          # built by the first attach
        if base_model is not None:
            self.attach(base_model, init_from_base=True)

    def build_parts(self, base_model) -> None:
        if self.eagle is None:
            self.eagle = EagleModule.from_base(base_model).train(self.training)

    @property
    def draft_module(self) -> nn.Module:
        return self.eagle


class Eagle3Heads(AutoregressiveHeads):
    """EAGLE-3: its own LM head (heads.lm_heads[0], no bias) over an Eagle3Module's normed predictions."""

    def __init__(self, config, base_model=None, draft_ids=None):
        super().__init__(config, draft_ids=draft_ids)
        self.eagle3: Eagle3Module | None = None        # built by the first attach
        if base_model is not None:
            self.attach(base_model, init_from_base=True)

    def build_parts(self, base_model) -> None:
        if self.eagle3 is None:
            self.eagle3 = Eagle3Module.from_base(base_model).train(self.training)

    @property
    def draft_module(self) -> nn.Module:
        return self.eagle3


@register_family
class Eagle(AutoregressiveFamily):
    """EAGLE-1 (models/methods/eagle/eagle.py): one decoder layer over (feature, next token) pairs."""
    name = "eagle"
    recipes = ("eagle",)
    heads_class = EagleHeads


@register_family
class Eagle3(AutoregressiveFamily):
    """EAGLE-3 (models/methods/eagle/eagle3.py): one layer over the base's fused taps and the next token, its own final
    norm and LM head (no bias, freshly initialised) over the draft vocabulary; trained by unrolling it over its own
    predictions."""
    name = "eagle3"
    recipes = ("eagle3",)
    heads_class = Eagle3Heads
    lm_head_bias = False
    lm_head_from_base = False                 # a fresh nn.Linear, as the authors' (models/methods/eagle/eagle3.py)

    def taps(self, base_config) -> tuple[int, ...]:
        return eagle3_taps(base_config.num_hidden_layers)
