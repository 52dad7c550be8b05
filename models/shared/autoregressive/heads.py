"""What the autoregressive methods' modules share (EAGLE-1, EAGLE-3, a draft model): their family's base and the heads
module that holds one draft module (models/shared/autoregressive/draft.py) beside its LM head. Each method subclasses both in
its own package (models/methods/eagle/family.py, models/methods/draft_model/family.py).

    heads = build_heads(HeadsConfig.for_base(model, family="eagle", num_heads=5), model)   # an EagleHeads
    heads.draft_module                  # its EagleModule (heads.eagle): unroll, readout, taps
"""
from __future__ import annotations

from torch import nn

from models.shared.draft_heads import DraftHeads
from models.shared.families import HeadFamily


class AutoregressiveFamily(HeadFamily):
    """A draft module run depth after depth over its own outputs, ending in the heads' (shared) LM head over the draft
    vocabulary. `num_heads` is the number of depths it is measured on (and, with the recipe's `unroll`, trained on);
    the blocks are empty. Drafted by models/shared/autoregressive/proposer.py."""
    autoregressive = True

    def build_blocks(self, hidden: int, num_heads: int, num_layers: int) -> nn.ModuleList:
        return nn.ModuleList([nn.Sequential() for _ in range(num_heads)])

    def num_lm_heads(self, num_heads: int) -> int:
        return 1                                  # every depth is the same module, read by the same LM head


class AutoregressiveHeads(DraftHeads):
    """Heads whose one module drafts every depth. A subclass declares the attribute that holds it in __init__ (None
    until the first attach builds it: build_parts) and returns it from `draft_module`."""

    @property
    def draft_module(self) -> nn.Module:
        raise NotImplementedError
