"""A Llama layer's config of the base's sizes: what a method builds its own decoder layers from, whatever the base's
architecture (EAGLE-3's layer, DFlash's draft layers): the base's hidden size, head counts, head_dim, intermediate
size, RMS eps, rotary base and scaling, no biases.

    config = layer_config(model.config)              # a transformers LlamaConfig, one layer
"""
from __future__ import annotations

from transformers import LlamaConfig


def rope_parameters(base_config) -> dict:
    """The base's rotary base and scaling as a Llama config takes them (transformers' rope_parameters): the
    full-attention layers' where they differ per layer type, without a partial rotary factor (the Llama layer
    rotates every dimension)."""
    params = dict(getattr(base_config, "rope_parameters", None) or getattr(base_config, "rope_scaling", None) or {})
    if isinstance(params.get("full_attention"), dict):
        params = dict(params["full_attention"])
    params.pop("partial_rotary_factor", None)
    params.setdefault("rope_theta", float(getattr(base_config, "rope_theta", 10000.0)))
    params["rope_type"] = params.get("rope_type", params.pop("type", "default"))
    return params


def layer_config(base_config) -> LlamaConfig:
    """A one-layer Llama config of the base's sizes (EAGLE-3's layer for this base, as the authors' and the loaders'
    is; DFlash's draft layers)."""
    heads = base_config.num_attention_heads
    head_dim = getattr(base_config, "head_dim", None) or base_config.hidden_size // heads
    eps = getattr(base_config, "rms_norm_eps", None) or getattr(base_config, "layer_norm_eps", None) or 1e-6
    config = LlamaConfig(
        vocab_size=base_config.vocab_size, hidden_size=base_config.hidden_size,
        intermediate_size=base_config.intermediate_size, num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=getattr(base_config, "num_key_value_heads", None) or heads, head_dim=head_dim,
        hidden_act="silu", rms_norm_eps=float(eps), max_position_embeddings=base_config.max_position_embeddings,
        rope_parameters=rope_parameters(base_config), attention_bias=False, mlp_bias=False,
        attn_implementation="sdpa")               # takes the drafter's additive tree masks, on CPU and GPU
    return config

