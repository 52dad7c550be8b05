"""Families: what makes one drafting method's module differ from another's, one HeadFamily subclass each, declared in
its method's package (models/methods/<method>/) and reached through its Method (models/shared/method.py; by name:
models.methods.method). This module holds the base class and the block every per-depth head has.

    family = models.methods.method("hydra").family  # or heads.family
    blocks = family.build_blocks(h, K, L)          # DraftHeads (models/shared/draft_heads.py) holds them
    x = family.head_input(k, h_t, path, embed)     # what head k reads before its blocks
    family.heads_class                             # the module class (None: DraftHeads); Hydra++'s adds its prefix layer
    family.taps(base.config)                       # the base states its module reads beside the final one

Adding a family is a HeadFamily subclass in the method's own package, named by its Method in models/methods/__init__.py,
and one conf/heads/<name>.yaml that names it.
"""
from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

class ResBlock(nn.Module):
    """x + SiLU(W x + b); W starts at zero so a fresh block is the identity."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x):
        return x + F.silu(self.linear(x))


def share_res_blocks(blocks: nn.ModuleList) -> nn.ModuleList:
    """Each head's ResBlocks made one module, applied in turn: what the authors' list multiplication builds
    (Medusa's `[ResBlock] * L`; Hydra's `[ResBlock] * (L - 1)` after its input block, so a 4-layer Hydra++ head
    has 2 distinct blocks). Changed in place and returned."""
    for head in blocks:
        first = None
        for i, block in enumerate(head):
            if isinstance(block, ResBlock):
                first = block if first is None else first
                head[i] = first
    return blocks


class HeadFamily:
    """The base: heads independent per depth, each a stack of ResBlocks on h_t (Medusa's behaviour). Subclasses
    override what differs; the class attributes are the capabilities shared code asks for."""
    name: ClassVar[str] = ""
    heads_class: ClassVar[type | None] = None  # the module class (a DraftHeads subclass); None: DraftHeads itself
    reads_path: ClassVar[bool] = False        # head k reads the k+1 path tokens above its node (Hydra)
    prefix_layer: ClassVar[bool] = False      # the heads read the hidden states through a layer with its own KV
    #                                           cache (DraftHeads.read_hidden; Hydra++'s prefix layer)
    autoregressive: ClassVar[bool] = False    # one draft module run depth after depth over its own outputs (EAGLE)
    # recipe kinds (its Method's) whose heads read one position each: they train on random positions of the hidden
    # cache (head_data.window_loader)
    window_recipes: ClassVar[tuple[str, ...]] = ()
    lm_head_bias: ClassVar[bool] = True       # own LM heads (share_lm_head false) have a bias
    lm_head_from_base: ClassVar[bool] = True  # own LM heads start as the base's (draft-vocabulary) rows
    assistant: ClassVar[bool] = False         # its draft module also runs as transformers' assistant model
    #                                           (the evaluation's sps_hf beside it)
    block_drafter: ClassVar[bool] = False     # a block drafted in one forward (DFlash): takes heads.mask_token_id
    #                                           and heads.sample_from_anchor

    def config_from_file(self, raw: dict) -> dict:
        """A saved heads_config.json's fields as this family reads them (a file from before a setting existed
        gets the value it was trained with): as they are."""
        return raw

    def num_lm_heads(self, num_heads: int) -> int:
        """Own LM heads built when the heads do not share the base's: one per head."""
        return num_heads

    def taps(self, base_config, num_layers: int = 1) -> tuple[int, ...]:
        """The base states (models/engine/taps.py) the heads read beside the final hidden state, for heads of
        num_layers layers (the heads config's): none."""
        return ()

    def build_blocks(self, hidden: int, num_heads: int, num_layers: int) -> nn.ModuleList:
        # each block its own module (`[ResBlock(h)] * L` would share one; HeadsConfig.shared_blocks asks for that)
        return nn.ModuleList([nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)]) for _ in range(num_heads)])

    def head_input(self, k: int, hidden: torch.Tensor, path_tokens: torch.Tensor | None, embed) -> torch.Tensor:
        """What head k's first block reads: hidden [..., h] (and path_tokens [..., k+1] when reads_path)."""
        return hidden

