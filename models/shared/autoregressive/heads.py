"""What the autoregressive methods' modules share (EAGLE-1, EAGLE-3, a draft model): their family's base and the heads
module that holds one draft module (models/shared/autoregressive/draft.py) beside its LM head. A method's family names
the attribute the module is held under (the name its saved weights carry) and builds it from the base
(models/methods/eagle/family.py, models/methods/draft_model/family.py).

    heads = models.methods.build_heads(HeadsConfig.for_base(model, family="eagle", num_heads=5), model)
    heads.draft_module                  # its EagleModule (heads.eagle): unroll, readout, taps
"""
from __future__ import annotations

import abc
from typing import ClassVar

from torch import nn

from models.shared.draft_heads import DraftHeads
from models.shared.families import HeadFamily


class AutoregressiveHeads(DraftHeads):
    """Heads whose one module drafts every depth, held under the family's `draft_attr` (None until the first attach
    builds it with the family's build_draft)."""

    def __init__(self, config, base_model=None, draft_ids=None, *, method):
        super().__init__(config, draft_ids=draft_ids, method=method)
        setattr(self, self.family.draft_attr, None)         # built by the first attach
        if base_model is not None:
            self.attach(base_model, init_from_base=True)

    def build_parts(self, base_model) -> None:
        if self.draft_module is None:
            module = self.family.build_draft(base_model, self.config).train(self.training)
            setattr(self, self.family.draft_attr, module)

    @property
    def draft_module(self) -> nn.Module | None:
        return getattr(self, self.family.draft_attr)


class AutoregressiveFamily(HeadFamily, abc.ABC):
    """A draft module run depth after depth over its own outputs, ending in the heads' (shared) LM head over the draft
    vocabulary. `num_heads` is the number of depths it is measured on (and, with the recipe's `unroll`, trained on);
    the blocks are empty. Drafted by models/shared/autoregressive/proposer.py. A subclass names the attribute its
    module is saved under (draft_attr) and builds it (build_draft)."""
    autoregressive = True
    heads_class = AutoregressiveHeads
    draft_attr: ClassVar[str] = ""

    @abc.abstractmethod
    def build_draft(self, base_model, config) -> nn.Module:
        """The draft module for `base_model` (config: the HeadsConfig)."""

    def build_blocks(self, hidden: int, num_heads: int, num_layers: int) -> nn.ModuleList:
        return nn.ModuleList([nn.Sequential() for _ in range(num_heads)])

    def num_lm_heads(self, num_heads: int) -> int:
        return 1                                  # every depth is the same module, read by the same LM head
