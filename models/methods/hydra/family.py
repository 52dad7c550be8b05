"""Hydra's and Hydra++'s families: head k also reads the embeddings of the path above its node (its first block,
HydraInputBlock, takes [h_t, E(x_{t+1}), ..., E(x_{t+k+1})]); Hydra++'s heads module adds the prefix layer
(models/methods/hydra/prefix.py). Both draft with the per-depth heads' proposer (models/shared/heads_proposer.py; its own: proposer.py): depth d
from its parents' paths, all parents of a depth in one batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.shared.families import HeadFamily, ResBlock
from models.methods.hydra.prefix import HydraPPHeads


class HydraInputBlock(nn.Module):
    """First Hydra block: [h_t, E(x_{t+1}), ..., E(x_{t+k+1})] (width h*(k+2)) -> h, with a residual projection.

    The residual projection starts as "take h_t" and the MLP at zero, so a fresh Hydra head equals
    a fresh Medusa head (and the base LM head when its Linear is copied from it).
    """

    def __init__(self, hidden: int, num_inputs: int):
        super().__init__()
        self.res_proj = nn.Linear(hidden * num_inputs, hidden, bias=False)
        self.linear = nn.Linear(hidden * num_inputs, hidden)
        with torch.no_grad():
            self.res_proj.weight.zero_()
            self.res_proj.weight[:, :hidden].copy_(torch.eye(hidden))
            self.linear.weight.zero_()

    def forward(self, x):                       # x: [..., h*(k+2)]
        return self.res_proj(x) + F.silu(self.linear(x))


class Hydra(HeadFamily):
    """Head k also reads the embeddings of the path above its node."""
    name = "hydra"
    reads_path = True
    window_recipes = ("hydra",)

    def build_blocks(self, hidden: int, num_heads: int, num_layers: int) -> nn.ModuleList:
        return nn.ModuleList([nn.Sequential(HydraInputBlock(hidden, k + 2), *[ResBlock(hidden) for _ in range(num_layers - 1)])
                              for k in range(num_heads)])

    def head_input(self, k, hidden, path_tokens, embed):
        if path_tokens is None or path_tokens.shape[-1] != k + 1:
            raise ValueError(f"{self.name} head {k} needs the {k + 1} path tokens above it, got "
                             f"{None if path_tokens is None else tuple(path_tokens.shape)}")
        emb = embed(path_tokens).to(hidden.dtype)                          # [..., k+1, h]
        return torch.cat([hidden.unsqueeze(-2), emb], dim=-2).flatten(-2)  # [..., h*(k+2)]


class HydraPP(Hydra):
    """Hydra with a prefix decoder layer (and final RMSNorm) over the base hidden states: its own KV cache
    receives accepted positions only, so it holds exactly the accepted sequence."""
    name = "hydra_pp"
    heads_class = HydraPPHeads
    prefix_layer = True
    window_recipes = ()
