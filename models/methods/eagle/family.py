"""EAGLE-1's and EAGLE-3's families: each holds its draft layer under its own attribute (`eagle`, `eagle3`: the names
its saved weights carry) in the shared autoregressive heads module, built from the base on the first attach; they draft
with the autoregressive proposer (models/shared/autoregressive/proposer.py).

    heads = models.methods.build_heads(HeadsConfig.for_base(model, family="eagle3", num_heads=5, draft_vocab_size=64),
                                       model, ids)
    heads.eagle3 is heads.draft_module        # an Eagle3Module; its LM head: heads.output_layer(0)
"""
from __future__ import annotations

from models.methods.eagle.eagle import EagleModule
from models.methods.eagle.eagle3 import Eagle3Module, eagle3_taps
from models.shared.autoregressive.heads import AutoregressiveFamily


class Eagle(AutoregressiveFamily):
    """EAGLE-1 (models/methods/eagle/eagle.py): one decoder layer over (feature, next token) pairs."""
    name = "eagle"
    draft_attr = "eagle"

    def build_draft(self, base_model, config) -> EagleModule:
        return EagleModule.from_base(base_model)


class Eagle3(AutoregressiveFamily):
    """EAGLE-3 (models/methods/eagle/eagle3.py): one layer over the base's fused taps and the next token, its own final
    norm and LM head (no bias, freshly initialised) over the draft vocabulary; trained by unrolling it over its own
    predictions."""
    name = "eagle3"
    draft_attr = "eagle3"
    lm_head_bias = False
    lm_head_from_base = False                 # a fresh nn.Linear, as the authors' (models/methods/eagle/eagle3.py)

    def build_draft(self, base_model, config) -> Eagle3Module:
        return Eagle3Module.from_base(base_model)

    def taps(self, base_config, num_layers: int = 1) -> tuple[int, ...]:
        return eagle3_taps(base_config.num_hidden_layers)
