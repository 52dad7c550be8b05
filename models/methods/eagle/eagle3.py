"""EAGLE-3's draft module: one Llama decoder layer over the base's fused low, middle and high features and the next
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
3h-wide features, as the authors' code does. Training runs that recurrence ("training-time test", models/shared/
autoregressive_training.py): each depth a soft cross-entropy to the base's distribution, weighted 0.8^k, no feature loss.

The layer is a Llama layer whatever the base's architecture, as the authors' code (SafeAILab/EAGLE, its EAGLE-3
`LlamaDecoderLayeremb`) and vLLM's and SGLang's loaders build it: transformers' Llama attention (q/k/v widened to
2h inputs), SwiGLU MLP and RMSNorms, made from `layer_config(base config)`: the base's hidden size, head counts,
head_dim, intermediate size, RMS eps, rotary base and scaling, no biases. Its rotary embedding is a Llama one of
that config (every dimension of a head rotated; the base's own may rotate part of them, e.g. Phi-3's partial
rotary). A Qwen3, Phi-3, OLMo-2 or Gemma-2 base gets the same layer as a Llama base of its sizes, so the export to
vLLM's and SGLang's format (models/methods/eagle/eagle3_format.py) is a renaming of names that stay the authors' (fc, the
layer's hidden_norm, input_layernorm, self_attn.*, mlp.*, norm).

Initialised as the authors' module is (a plain nn.Module: no initialiser of transformers runs): every Linear
(fc and the layer's) by nn.Linear's own init (Kaiming-uniform, bound 1/sqrt(fan_in)), every RMSNorm weight
(input_layernorm, hidden_norm, post_attention_layernorm, the final norm) at one. Its LM head (the heads', models/
methods/eagle/family.py Eagle3) is a fresh nn.Linear too, as theirs is. float32.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from models.engine.kv_cache import cache_kwargs
from models.shared.autoregressive.draft import AutoregressiveDraft
from models.shared.layer_config import layer_config


def eagle3_taps(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's three taps for a base of `num_layers` decoder layers: low, middle and high (2, L // 2, L - 3), as the
    authors' code and vLLM's and SGLang's loaders take them; a base of fewer than 5 layers (tests' tiny models)
    gets them clamped to its layer outputs 1..L."""
    if num_layers < 1:
        raise ValueError(f"a base of {num_layers} decoder layers has no hidden states to tap")
    return tuple(min(max(i, 1), num_layers) for i in (2, num_layers // 2, num_layers - 3))


class Eagle3Layer(nn.Module):
    """A Llama decoder layer with attention over [normed embedding ; normed feature]. Called like a transformers
    decoder layer on x = [embedding ; feature] ([B, T, 2h]), -> [B, T, h]."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        h = self.hidden_size = config.hidden_size
        self.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx=0)             # the only layer of its own cache
        for name in ("q_proj", "k_proj", "v_proj"):                      # q/k/v read 2h
            setattr(self.self_attn, name, nn.Linear(2 * h, getattr(self.self_attn, name).out_features, bias=False))
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        with torch.no_grad():                                            # the authors' init, stated, not assumed
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    m.reset_parameters()
                elif isinstance(m, LlamaRMSNorm):
                    m.weight.fill_(1.0)

    def forward(self, x: torch.Tensor, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, **kwargs) -> torch.Tensor:
        emb, feature = x[..., :self.hidden_size], x[..., self.hidden_size:]                 # [B, T, h] each
        a = torch.cat([self.input_layernorm(emb), self.hidden_norm(feature)], dim=-1)        # [B, T, 2h]
        attn = self.self_attn(hidden_states=a, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=use_cache, position_embeddings=position_embeddings,
                              **cache_kwargs(self.self_attn, cache), **kwargs)
        h = feature + (attn[0] if isinstance(attn, tuple) else attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Module(AutoregressiveDraft):
    """fc (3h -> h, no bias), one Eagle3Layer, the final norm and the layer's own rotary embedding; base parts by
    reference. The LM head is the heads' (DraftHeads.output_layer(0): one Linear over the draft vocabulary for
    every depth)."""

    def __init__(self, fc: nn.Linear, layer: Eagle3Layer, norm: nn.Module, base_model, taps: tuple[int, ...],
                 config: LlamaConfig):
        super().__init__(base_model)
        self.fc, self.layers, self.out_norm = fc, nn.ModuleList([layer]), norm
        self.rotary_emb = LlamaRotaryEmbedding(config)                  # buffers only, not saved
        self.layer_config, self.taps = config, tuple(taps)

    @classmethod
    def from_base(cls, base_model, seed: int | None = None) -> "Eagle3Module":
        """A fresh (untrained) module for `base_model`; `seed` makes its initial weights reproducible."""
        config = layer_config(base_model.config)
        h = config.hidden_size
        taps = eagle3_taps(base_model.config.num_hidden_layers)
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            fc = nn.Linear(len(taps) * h, h, bias=False)
            layer = Eagle3Layer(config)
        norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        device = base_model.get_output_embeddings().weight.device
        return cls(fc, layer, norm, base_model, taps, config).to(device=device, dtype=torch.float32).train(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def rotary(self, x: torch.Tensor, position_ids: torch.Tensor):
        return self.rotary_emb(x, position_ids)

    def inputs(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        f = features.to(self.dtype)
        if f.shape[-1] != self.base_config.hidden_size:                  # the base's taps: fuse them
            f = self.fc(f)
        return torch.cat([self.embed(next_tokens), f], dim=-1)           # [B, T, 2h]: the layer splits it

    def readout(self, pred: torch.Tensor) -> torch.Tensor:
        return self.out_norm(pred)
