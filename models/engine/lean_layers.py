"""Llama decoder layers run without transformers' module plumbing, for decoding on a CPU.

    use_lean_layers(model)     # True where every decoder layer is a plain Llama layer; stock_layers(model) undoes it

A 1-token step of a small model on a slow CPU pays for each layer's ~13 module calls, a decorator and the keyword
plumbing as much as for some of its products: on a 2-core AVX2 EPYC, SmolLM2-135M's plain step ran at 0.85
[0.82, 0.89] of its time with these layers (docs/cost.md). The lean forward runs the same operators in the same order
as LlamaDecoderLayer's (the norms as LlamaRMSNorm computes them, the rotary as apply_rotary_pos_emb, the cache's
update and the model's attention function as LlamaAttention calls them, the linears as fast_inference leaves them),
so its hidden states are the stock layer's bit for bit. It hands over to the stock forward wherever it would not be
the same: gradients on, training mode, a cache other than the engine's GrowingCache (the static step's), any
argument it does not know, a layer no longer plain Llama (a draft's copy of a base layer, its parts replaced). The layer is still called as a module, so forward hooks (the taps) run as before.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from transformers.models.llama import modeling_llama as llama

from models.engine import fast_inference as fi
from models.engine.kv_cache import GrowingCache

KNOWN = {"attention_mask", "position_ids", "cache", "past_key_values", "use_cache", "position_embeddings"}


def _norm(norm, x: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm.forward's operators."""
    dtype, x = x.dtype, x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    return norm.weight * (x * torch.rsqrt(variance + norm.variance_epsilon)).to(dtype)


def _lean_forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if (torch.is_grad_enabled() or self.training or not KNOWN.issuperset(kwargs)
            or not (cache is None or isinstance(cache, GrowingCache)) or kwargs.get("position_embeddings") is None
            or not _plain_llama(self)):           # a copy since changed (EAGLE's draft layer drops its first norm)
        return type(self).forward(self, hidden_states, **kwargs)
    a, m = self.self_attn, self.mlp
    shape = (*hidden_states.shape[:-1], -1, a.head_dim)
    x = _norm(self.input_layernorm, hidden_states)
    q = fi.linear(a.q_proj, x).view(shape).transpose(1, 2)
    k = fi.linear(a.k_proj, x).view(shape).transpose(1, 2)
    v = fi.linear(a.v_proj, x).view(shape).transpose(1, 2)
    cos, sin = kwargs["position_embeddings"]
    q, k = llama.apply_rotary_pos_emb(q, k, cos, sin)
    if cache is not None:
        k, v = cache.update(k, v, a.layer_idx)
    implementation = getattr(a.config, "_attn_implementation", "sdpa")              # the model's, as set now
    attention = llama.ALL_ATTENTION_FUNCTIONS.get_interface(implementation, llama.eager_attention_forward)
    out, _ = attention(a, q, k, v, kwargs.get("attention_mask"), dropout=0.0, scaling=a.scaling)
    hidden_states = hidden_states + fi.linear(a.o_proj, out.reshape(*shape[:-2], -1).contiguous())
    x = _norm(self.post_attention_layernorm, hidden_states)
    return hidden_states + fi.linear(m.down_proj, m.act_fn(fi.linear(m.gate_proj, x)) * fi.linear(m.up_proj, x))


def _plain_llama(layer) -> bool:
    a, m = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    return (type(layer) is llama.LlamaDecoderLayer and type(a) is llama.LlamaAttention and type(m) is llama.LlamaMLP
            and type(layer.input_layernorm) is llama.LlamaRMSNorm
            and type(layer.post_attention_layernorm) is llama.LlamaRMSNorm
            and all(type(p) is torch.nn.Linear for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj,
                                                          m.up_proj, m.down_proj)))


def lean_layers_apply(model) -> bool:
    layers = getattr(model.get_decoder(), "layers", None)
    return bool(layers) and all(_plain_llama(layer) for layer in layers)


def use_lean_layers(model) -> bool:
    """Give every decoder layer the lean forward where all of them are plain Llama layers; returns whether it did."""
    if not lean_layers_apply(model):
        return False
    for layer in model.get_decoder().layers:
        layer.forward = types.MethodType(_lean_forward, layer)
    return True


def stock_layers(model) -> None:
    for layer in getattr(model.get_decoder(), "layers", None) or []:
        if getattr(layer.forward, "__func__", None) is _lean_forward:
            del layer.forward                      # the class's forward again


def has_lean_layers(model) -> bool:
    layers = getattr(model.get_decoder(), "layers", None) or []
    return bool(layers) and all(getattr(layer.forward, "__func__", None) is _lean_forward for layer in layers)
