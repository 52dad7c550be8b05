"""Families: what makes each drafting method's heads differ (Medusa, Hydra, Hydra++, EAGLE, EAGLE-3, the draft
model), one class each, found by name.

    family = get_family("hydra")                   # the `family` of conf/heads/<name>.yaml
    blocks = family.build_blocks(h, K, L)          # models/heads/__init__.py DraftHeads holds them
    x = family.head_input(k, h_t, path, embed)     # what head k reads before its blocks
    # drafting: models/heads/proposers.py (Medusa, Hydra, Hydra++), autoregressive_proposer.py (the rest)
    family.recipes                                 # the training recipes it takes (models/heads/training.py RECIPES)

Adding a family is a HeadFamily subclass decorated with @register_family (here, or in a module imported
where it is used) and one conf/heads/<name>.yaml that names it.
"""
from __future__ import annotations

import copy

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from models.engine.taps import eagle3_taps
from models.heads.draft_model import DraftModel
from models.heads.eagle import EagleModule
from models.heads.eagle3 import Eagle3Module

FAMILIES: dict[str, "HeadFamily"] = {}


def register_family(cls: type["HeadFamily"]) -> type["HeadFamily"]:
    """Class decorator: makes `cls` reachable as get_family(cls.name)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a `name`")
    FAMILIES[cls.name] = cls()
    return cls


def get_family(name: str) -> "HeadFamily":
    if name not in FAMILIES:
        raise ValueError(f"heads family {name!r} is not known; use one of {sorted(FAMILIES)} "
                         "(a new family registers itself with models.heads.families.register_family)")
    return FAMILIES[name]


class ResBlock(nn.Module):
    """x + SiLU(W x + b); W starts at zero so a fresh block is the identity."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x):
        return x + F.silu(self.linear(x))


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
    """The base: Medusa's behaviour. Subclasses override what differs."""
    name: ClassVar[str] = ""
    reads_path: ClassVar[bool] = False        # head k reads the k+1 path tokens above its node (Hydra)
    prefix_layer: ClassVar[bool] = False      # a decoder layer over the base hidden states first (Hydra++)
    autoregressive: ClassVar[bool] = False    # one draft module run depth after depth over its own outputs (EAGLE)
    recipes: ClassVar[tuple[str, ...]] = ()   # models/heads/training.py RECIPES it can be trained with
    # heads that read one position each train on random positions of the hidden cache (head_data.window_loader)
    window_recipes: ClassVar[tuple[str, ...]] = ()
    lm_head_bias: ClassVar[bool] = True       # own LM heads (share_lm_head false) have a bias
    lm_head_from_base: ClassVar[bool] = True  # own LM heads start as the base's (draft-vocabulary) rows

    def num_lm_heads(self, num_heads: int) -> int:
        """Own LM heads built when the heads do not share the base's: one per head."""
        return num_heads

    def taps(self, base_config) -> tuple[int, ...]:
        """The base states (models/engine/taps.py) the heads read beside the final hidden state: none."""
        return ()

    def build_blocks(self, hidden: int, num_heads: int, num_layers: int) -> nn.ModuleList:
        # each block its own module (`[ResBlock(h)] * L` would share one; HeadsConfig.shared_blocks asks for that)
        return nn.ModuleList([nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)]) for _ in range(num_heads)])

    def head_input(self, k: int, hidden: torch.Tensor, path_tokens: torch.Tensor | None, embed) -> torch.Tensor:
        """What head k's first block reads: hidden [..., h] (and path_tokens [..., k+1] when reads_path)."""
        return hidden

    def build_extra(self, heads, base_model) -> None:
        """The family's own modules beside the heads' blocks, made from the base model when the heads are first
        attached (Hydra++: heads.prefix_layer and heads.prefix_norm; EAGLE: heads.eagle); a later attach keeps
        them. None by default."""

    def draft_module(self, heads):
        """An autoregressive family's draft module (models/heads/autoregressive.py) in `heads`; None otherwise."""
        return None


@register_family
class Medusa(HeadFamily):
    name = "medusa"
    recipes = ("medusa1", "medusa2")
    window_recipes = ("medusa1",)


@register_family
class Hydra(HeadFamily):
    """Head k also reads the embeddings of the path above its node: depth d is drafted from its parents'
    paths, all parents of a depth in one batch."""
    name = "hydra"
    reads_path = True
    recipes = ("hydra",)
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


@register_family
class HydraPP(Hydra):
    """Hydra with a prefix decoder layer (and final RMSNorm) over the base hidden states: its own KV cache
    receives accepted positions only, so it holds exactly the accepted sequence."""
    name = "hydra_pp"
    prefix_layer = True
    recipes = ("hydra_pp",)
    window_recipes = ()

    def build_extra(self, heads, base_model) -> None:
        """One extra decoder layer of the base architecture and a final RMSNorm (a 1-layer decoder model).
        o_proj/down_proj start at zero, so the layer starts as the identity; the norm's weight starts at the RMS
        of the base's final-norm weight, the typical RMS of the base's final hidden states, so a fresh Hydra++
        drafts like a fresh Hydra (same direction, about the same scale)."""
        if heads.prefix_layer is not None:
            return
        decoder = base_model.get_decoder()
        heads.prefix_layer = copy.deepcopy(decoder.layers[-1])
        heads.prefix_layer.self_attn.layer_idx = 0
        heads.prefix_norm = copy.deepcopy(decoder.norm)
        with torch.no_grad():
            heads.prefix_layer.self_attn.o_proj.weight.zero_()
            heads.prefix_layer.mlp.down_proj.weight.zero_()
            heads.prefix_norm.weight.fill_(float(decoder.norm.weight.float().pow(2).mean().sqrt()))
        for part in (heads.prefix_layer, heads.prefix_norm):
            part.to(dtype=torch.float32).train(heads.training)        # copies of eval-mode base modules


class AutoregressiveFamily(HeadFamily):
    """A draft module run depth after depth over its own outputs (models/heads/autoregressive.py), ending in the
    heads' (shared) LM head over the draft vocabulary. `num_heads` is the number of depths it is measured on
    (and, with the recipe's `unroll`, trained on); the blocks are empty. Drafted by
    models/heads/autoregressive_proposer.py."""
    autoregressive = True
    attribute: ClassVar[str] = ""             # where the heads hold the module

    def build_blocks(self, hidden: int, num_heads: int, num_layers: int) -> nn.ModuleList:
        return nn.ModuleList([nn.Sequential() for _ in range(num_heads)])

    def num_lm_heads(self, num_heads: int) -> int:
        return 1                                  # every depth is the same module, read by the same LM head

    def build_extra(self, heads, base_model) -> None:
        if getattr(heads, self.attribute, None) is None:
            setattr(heads, self.attribute, self.make_module(heads, base_model).train(heads.training))

    def make_module(self, heads, base_model) -> nn.Module:
        raise NotImplementedError

    def draft_module(self, heads):
        return getattr(heads, self.attribute)


@register_family
class Eagle(AutoregressiveFamily):
    """EAGLE-1 (models/heads/eagle.py): one decoder layer over (feature, next token) pairs."""
    name = "eagle"
    recipes = ("eagle",)
    attribute = "eagle"

    def make_module(self, heads, base_model) -> nn.Module:
        return EagleModule.from_base(base_model)


@register_family
class DraftModelFamily(AutoregressiveFamily):
    """A small draft model (models/heads/draft_model.py): num_layers decoder layers over the tokens alone."""
    name = "draft_model"
    recipes = ("draft_model",)
    attribute = "draft_model"

    def make_module(self, heads, base_model) -> nn.Module:
        return DraftModel.from_base(base_model, num_layers=heads.config.num_layers)


@register_family
class Eagle3(AutoregressiveFamily):
    """EAGLE-3 (models/heads/eagle3.py): one layer over the base's fused taps and the next token, its own final norm
    and LM head (no bias, freshly initialised) over the draft vocabulary; trained by unrolling it over its own
    predictions."""
    name = "eagle3"
    recipes = ("eagle3",)
    attribute = "eagle3"
    lm_head_bias = False
    lm_head_from_base = False                 # a fresh nn.Linear, as the authors' (models/heads/eagle3.py)

    def make_module(self, heads, base_model) -> nn.Module:
        return Eagle3Module.from_base(base_model)

    def taps(self, base_config) -> tuple[int, ...]:
        return eagle3_taps(base_config.num_hidden_layers)
