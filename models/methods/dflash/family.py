"""DFlash's family and heads module: the draft module (models/methods/dflash/dflash.py) held as `heads.dflash`, built
from the base on the first attach, scored by the heads' LM head (the base's, shared, over the draft vocabulary, as the
authors score the draft with the target's). `num_heads` is the block's drafting slots (block size - 1; the block size
with heads.sample_from_anchor, where slot 0 drafts too), each a "head" for the validation metrics and for the trees
drafted from each position's top-k; `num_layers` its layers.

    heads = models.methods.build_heads(HeadsConfig.for_base(model, family="dflash", num_heads=15, num_layers=2,
                                                            share_lm_head=True), model)
    heads.dflash.taps                        # the base states it reads, one per draft layer
"""
from __future__ import annotations

from torch import nn

from models.methods.dflash.dflash import DFlashModule, dflash_taps
from models.shared.draft_heads import DraftHeads
from models.shared.families import HeadFamily


class DFlashHeads(DraftHeads):
    """DraftHeads with the draft module `dflash` (None until the first attach builds it)."""

    def __init__(self, config, base_model=None, draft_ids=None, *, method):
        super().__init__(config, draft_ids=draft_ids, method=method)
        self.dflash: DFlashModule | None = None
        if base_model is not None:
            self.attach(base_model, init_from_base=True)

    def build_parts(self, base_model) -> None:
        if self.dflash is None:
            c = self.config       # num_heads: the depths drafted, one slot fewer than the block without
            self.dflash = DFlashModule.from_base(     # sample_from_anchor (slot 0, the anchor, drafts nothing)
                base_model, c.num_layers, block_size=c.num_heads + (0 if c.sample_from_anchor else 1),
                mask_token_id=c.mask_token_id, sample_from_anchor=c.sample_from_anchor).train(self.training)

    @property
    def draft_module(self) -> nn.Module | None:
        return self.dflash


class DFlash(HeadFamily):
    """A block drafted in one forward; the blocks per head are empty (the module drafts every position)."""
    name = "dflash"
    heads_class = DFlashHeads
    block_drafter = True

    def config_from_file(self, raw: dict) -> dict:
        """A heads_config.json from before heads.mask_token_id existed: its drafter was trained with the base's last
        id as the mask (the module's fixed choice then)."""
        return raw if "mask_token_id" in raw else {**raw, "mask_token_id": raw["vocab_size"] - 1}

    def build_blocks(self, hidden: int, num_heads: int, num_layers: int) -> nn.ModuleList:
        return nn.ModuleList([nn.Sequential() for _ in range(num_heads)])

    def num_lm_heads(self, num_heads: int) -> int:
        return 1                                  # every position is read by the same LM head

    def taps(self, base_config, num_layers: int = 1) -> tuple[int, ...]:
        return dflash_taps(base_config.num_hidden_layers, num_layers)
