"""Hydra++'s heads module: Hydra's heads read the base's hidden states through a prefix layer, one extra decoder layer
of the base's architecture with its own final RMSNorm (a 1-layer decoder model, docs/reference.md#heads), run causally
with its own KV cache (which the proposer feeds accepted positions only).

    heads = models.methods.build_heads(HeadsConfig.for_base(model, family="hydra_pp", num_heads=4, num_layers=4), model)
    h = heads.read_hidden(hidden, position_ids, cache=cache)      # [B, T, h] -> [B, T, h], through the prefix layer
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from models.engine.kv_cache import cache_kwargs
from models.shared.draft_heads import DraftHeads


class HydraPPHeads(DraftHeads):
    """DraftHeads with `prefix_layer` and `prefix_norm` (saved under those names), built from the base on the first
    attach: a copy of its last decoder layer whose o_proj/down_proj start at zero, so the layer starts as the
    identity, and a copy of its final norm whose weight starts at the RMS of the base's final-norm weight (the typical
    RMS of the base's final hidden states), so a fresh Hydra++ drafts like a fresh Hydra (same direction, about the
    same scale)."""

    def __init__(self, config, base_model=None, draft_ids=None, *, method):
        super().__init__(config, draft_ids=draft_ids, method=method)
        self.prefix_layer: nn.Module | None = None     # built by the first attach
        self.prefix_norm: nn.Module | None = None
        if base_model is not None:
            self.attach(base_model, init_from_base=True)

    def build_parts(self, base_model) -> None:
        if self.prefix_layer is not None:
            return
        decoder = base_model.get_decoder()
        self.prefix_layer = copy.deepcopy(decoder.layers[-1])
        self.prefix_layer.self_attn.layer_idx = 0
        self.prefix_norm = copy.deepcopy(decoder.norm)
        with torch.no_grad():
            self.prefix_layer.self_attn.o_proj.weight.zero_()
            self.prefix_layer.mlp.down_proj.weight.zero_()
            self.prefix_norm.weight.fill_(float(decoder.norm.weight.float().pow(2).mean().sqrt()))
        for part in (self.prefix_layer, self.prefix_norm):
            part.to(dtype=torch.float32).train(self.training)        # copies of eval-mode base modules

    def read_hidden(self, hidden: torch.Tensor, position_ids: torch.Tensor, cache=None) -> torch.Tensor:
        """The prefix layer and its final norm over base hidden states, causal. [B, T, h] -> [B, T, h].

        With a `cache` (a transformers DynamicCache of one layer), earlier positions come from it."""
        self._require_base()
        B, T, _ = hidden.shape
        past = cache.get_seq_length() if cache is not None else 0
        dtype = self.prefix_layer.self_attn.o_proj.weight.dtype
        x = hidden.to(dtype)
        causal = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
        mask = torch.zeros(B, 1, T, past + T, dtype=dtype, device=x.device)
        mask.masked_fill_(~causal, torch.finfo(dtype).min)
        pos_emb = self._base["rotary"](x, position_ids)
        out = self.prefix_layer(x, attention_mask=mask, position_ids=position_ids, use_cache=cache is not None,
                                position_embeddings=pos_emb, **cache_kwargs(self.prefix_layer, cache))
        out = out[0] if isinstance(out, tuple) else out
        return self.prefix_norm(out).to(hidden.dtype)
