"""EAGLE-1's draft module: one decoder layer that predicts the base model's next feature (docs/reference.md#autoregressive-drafters).

    eagle = EagleModule.from_base(model, seed=0)                  # fc + one decoder layer of the base's architecture
    pred = eagle(features, next_tokens, position_ids, cache=cache)  # and unroll, logits: models/shared/autoregressive/draft.py
    drafter = EagleDrafter(eagle, spec)                            # a bare module on a tree: models/methods/eagle/drafter.py

At position t EAGLE reads f_t, the base's final hidden state (after its final norm: transformers'
last_hidden_state), and x_{t+1}, the token after it, embedded by the frozen base embedding:

    x    = fc(cat([embed(x_{t+1}) ; f_t]))      [B, T, 2h] -> [B, T, h]    Linear with bias
    pred = layers[0](x)                         [B, T, h] -> [B, T, h]     one decoder layer of the base's class,
                                                                           its input norm removed, no final norm
pred is the predicted f_{t+1}; the base LM head over it scores x_{t+2}. Like eagle-llm 1.2.1's cnets.py
(embedding first, then feature; the only layer skips input_layernorm; its weights are named fc.* and
layers.0.* there too) at the position t of f_t.

The layer is a copy of the base's last decoder layer with every Linear re-initialised (normal, the base
config's initializer_range, zero biases; the norms are the base's); fc has torch's default init. state_dict()
holds fc and the layer only. The module computes in float32 whatever the base's dtype.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from models.shared.autoregressive.draft import AutoregressiveDraft, reinit_linears


class EagleModule(AutoregressiveDraft):
    """fc (2h -> h, bias) and one decoder layer (layer index 0 of its own KV cache); base parts by reference."""

    def __init__(self, fc: nn.Linear, layer: nn.Module, base_model):
        super().__init__(base_model)
        self.fc, self.layers = fc, nn.ModuleList([layer])

    @classmethod
    def from_base(cls, base_model, seed: int | None = None) -> "EagleModule":
        """A fresh (untrained) module for `base_model`: a re-initialised copy of its last decoder layer without
        the input norm, and fc; `seed` makes the initial weights reproducible (None: torch's global RNG)."""
        decoder = base_model.get_decoder()
        h = base_model.config.hidden_size
        std = float(getattr(base_model.config, "initializer_range", 0.02))
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            fc = nn.Linear(2 * h, h, bias=True)
            layer = copy.deepcopy(decoder.layers[-1]).to(device="cpu", dtype=torch.float32)
            layer.self_attn.layer_idx = 0                     # the only layer of its own cache
            layer.input_layernorm = nn.Identity()             # EAGLE-1: no input norm (its input is fc's output)
            reinit_linears(layer, std)
        device = base_model.get_output_embeddings().weight.device
        return cls(fc, layer, base_model).to(device=device, dtype=torch.float32).train(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def inputs(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.embed(next_tokens), features.to(self.dtype)], dim=-1))  # [B, T, 2h] -> [B, T, h]
