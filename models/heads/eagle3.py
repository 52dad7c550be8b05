"""EAGLE-3's draft module: one decoder layer over the base's fused low, middle and high features and the next
token's embedding, with its own final norm and LM head over the draft vocabulary (docs/reference.md#autoregressive-drafters).

    module = Eagle3Module.from_base(model, seed=0)       # fc (3h -> h), the layer, the final norm
    module.taps                                          # (2, L // 2, L - 3): the base states it reads (models/engine/taps.py)
    pred = module(features, next_tokens, position_ids, cache=cache)   # features [B, T, 3h] (taps) or [B, T, h] (its own)
    logits = heads.lm_head(0, module.readout(pred))      # the final norm, then the heads' one LM head

At position t the first depth reads g_t = cat(taps of t) [3h] and x_{t+1}:

    f      = fc(g_t)                                           [3h] -> [h], no bias
    a      = cat([input_layernorm(embed(x_{t+1})) ; hidden_norm(f)])   [2h]: q/k/v read both
    f'     = f + attn(a);  pred = f' + mlp(post_attention_layernorm(f'))
    logits = lm_head(norm(pred))                               over the draft vocabulary

Deeper depths feed pred (before the final norm, width h) back in place of fc's output: `inputs` applies fc only to
3h-wide features, as the authors' code does. Training runs that recurrence ("training-time test", models/heads/
eagle_training.py): each depth a soft cross-entropy to the base's distribution, weighted 0.8^k, no feature loss.

The layer is the base's last decoder layer with q/k/v widened to 2h inputs and every Linear re-initialised (normal,
the base config's initializer_range); its norms, hidden_norm and the final norm start as the base's (input norm,
final norm). Names follow the authors' (fc, the layer's hidden_norm, input_layernorm, self_attn.*, mlp.*, norm), so
the export to vLLM's and SGLang's format (models/heads/eagle3_format.py) is a renaming. float32.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from models.engine.taps import eagle3_taps
from models.heads.autoregressive import AutoregressiveDraft, reinit_linears


class Eagle3Layer(nn.Module):
    """The base's decoder layer with attention over [normed embedding ; normed feature]. Called like a transformers
    decoder layer on x = [embedding ; feature] ([B, T, 2h]), -> [B, T, h]."""

    def __init__(self, base_layer: nn.Module, hidden: int, std: float):
        super().__init__()
        self.hidden_size = hidden
        self.input_layernorm = copy.deepcopy(base_layer.input_layernorm)
        self.hidden_norm = copy.deepcopy(base_layer.input_layernorm)
        self.self_attn = copy.deepcopy(base_layer.self_attn)
        self.post_attention_layernorm = copy.deepcopy(base_layer.post_attention_layernorm)
        self.mlp = copy.deepcopy(base_layer.mlp)
        self.self_attn.layer_idx = 0                                      # the only layer of its own cache
        for name in ("q_proj", "k_proj", "v_proj"):                      # q/k/v read 2h
            old = getattr(self.self_attn, name)
            setattr(self.self_attn, name, nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None))
        reinit_linears(self, std)

    def forward(self, x: torch.Tensor, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs) -> torch.Tensor:
        emb, feature = x[..., :self.hidden_size], x[..., self.hidden_size:]                 # [B, T, h] each
        a = torch.cat([self.input_layernorm(emb), self.hidden_norm(feature)], dim=-1)        # [B, T, 2h]
        attn = self.self_attn(hidden_states=a, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=past_key_values, use_cache=use_cache,
                              position_embeddings=position_embeddings, **kwargs)
        h = feature + (attn[0] if isinstance(attn, tuple) else attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Module(AutoregressiveDraft):
    """fc (3h -> h, no bias), one Eagle3Layer, the final norm; base parts by reference. The LM head is the heads'
    (DraftHeads.output_layer(0): one Linear over the draft vocabulary for every depth)."""

    def __init__(self, fc: nn.Linear, layer: Eagle3Layer, norm: nn.Module, base_model, taps: tuple[int, ...]):
        super().__init__(base_model)
        self.fc, self.layers, self.out_norm = fc, nn.ModuleList([layer]), norm
        self.taps = tuple(taps)

    @classmethod
    def from_base(cls, base_model, seed: int | None = None) -> "Eagle3Module":
        """A fresh (untrained) module for `base_model`; `seed` makes its initial weights reproducible."""
        decoder = base_model.get_decoder()
        config = base_model.config
        h, std = config.hidden_size, float(getattr(config, "initializer_range", 0.02))
        taps = eagle3_taps(config.num_hidden_layers)
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            fc = nn.Linear(len(taps) * h, h, bias=False)
            base_layer = copy.deepcopy(decoder.layers[-1]).to(device="cpu", dtype=torch.float32)
            layer = Eagle3Layer(base_layer, h, std)
        norm = copy.deepcopy(decoder.norm).to(device="cpu", dtype=torch.float32)
        device = base_model.get_output_embeddings().weight.device
        return cls(fc, layer, norm, base_model, taps).to(device=device, dtype=torch.float32).train(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def inputs(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        f = features.to(self.dtype)
        if f.shape[-1] != self.base_config.hidden_size:                  # the base's taps: fuse them
            f = self.fc(f)
        return torch.cat([self.embed(next_tokens), f], dim=-1)           # [B, T, 2h]: the layer splits it

    def readout(self, pred: torch.Tensor) -> torch.Tensor:
        return self.out_norm(pred)
