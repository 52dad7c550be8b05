"""Inference-only speed-ups for decoding on a CPU, applied to a loaded model (baseline and speculative alike).

    info = prepare_for_decoding(model)   # models/engine/path_choice.py: the paths below that pay on this machine

A decoding step of a small model on a CPU is bound by reading the weights, so a verify step over a
handful of tree tokens should cost little more than a 1-token step. Two things made it cost more
(measured with torch.profiler on SmolLM2-135M, 2 cores):
  1) nn.Linear (MKL sgemm) re-packs the weight panel on every call with more than one row. Weights
     reordered ONCE into oneDNN's blocked layout (torch.ops.mkldnn._reorder_linear_weight) are read as
     they are by torch.ops.mkldnn._linear_pointwise at any row count (`pack_linears`).
  2) transformers' SDPA path copies the keys and values of the whole cache once per layer and step
     (repeat_kv) for grouped-query attention whenever a mask is given, i.e. on every tree verify step
     (a 1-token step folds the query heads instead). `sdpa_gqa_folded` folds the n_rep query heads of
     one key/value head into the query-length axis, [B, H, N, d] -> [B, H_kv, n_rep*N, d], tiles the
     mask to match, and runs the same SDPA with no copy of the cache: the same arithmetic.
Draft heads get the same packed linears, in bfloat16 where the CPU has bf16 arithmetic (their products
only pick the drafts; the base model, which decides the output, stays float32).
Whether each pays depends on the machine (packed linears slow a 2-core AMX Xeon's 1-row step by a third), so
prepare_for_decoding times them in place and keeps the faster (models/engine/path_choice.py).
Both keep the model's own forward (no copied modeling code) and fall back to the stock path wherever
they do not apply (gradients on, another device or dtype, no mask, no grouped heads).
"""
from __future__ import annotations

import types
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from models.hardware import cpu_has_fast_bf16

GQA_FOLDED = "sdpa_gqa_folded"
# Linear -> ((weight data_ptr, version), packed weight). Kept outside the modules: a deep copy of a prepared
# model (the Hydra++ prefix layer is one) must not copy oneDNN's opaque tensors; the copy falls back to F.linear.
_PACKED: "weakref.WeakKeyDictionary[nn.Linear, tuple]" = weakref.WeakKeyDictionary()
# The base model's own linears (own_linears): never packed for drafting in bfloat16, even where the heads share one
_BASE: "weakref.WeakSet[nn.Linear]" = weakref.WeakSet()


# -- 1) prepacked linears ------------------------------------------------------------------------
def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def is_packed(module) -> bool:
    return module in _PACKED


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    key, packed, bias = _PACKED.get(self, (None, None, None))
    w = self.weight
    if packed is None or torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != torch.float32 or key != (w.data_ptr(), w._version):
        return F.linear(x, w, self.bias)
    if bias is None:                     # a float32 copy keeps no bias of its own: the module's is used
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
    # bf16 copy (draft heads only): float32 in and out, the weights read at half the bytes
    return torch.ops.mkldnn._linear_pointwise(x.to(bias.dtype), packed, bias, "none", [], "").float()


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """module(x) without nn.Module's call machinery, for a caller with gradients off (lean_layers.py): its float32
    packed copy where that is valid, else as the module's own forward would."""
    entry = _PACKED.get(module)
    if entry is None:
        return F.linear(x, module.weight, module.bias)
    key, packed, bias = entry
    w = module.weight
    if bias is None and x.dtype == torch.float32 and key == (w.data_ptr(), w._version):
        return torch.ops.mkldnn._linear_pointwise(x, packed, module.bias, "none", [], "")
    return _packed_forward(module, x)


def own_linears(model: nn.Module) -> None:
    """Mark every linear of base `model` as the base's: prepare_heads_for_decoding leaves them as they are."""
    _BASE.update(m for m in model.modules() if type(m) is nn.Linear)


def pack_linears(model: nn.Module, dtype: torch.dtype = torch.float32, skip_base: bool = False) -> int:
    """Give every float32 CPU nn.Linear of `model` a packed copy of its weight, in `dtype` (float32: the same
    products; bfloat16: for drafting only, never for the base model, whose logits decide the output);
    returns how many. A module packed already keeps its copy while its weights are unchanged."""
    if not packing_available():
        return 0
    n = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if type(module) is not nn.Linear or w.device.type != "cpu" or w.dtype != torch.float32:
            continue
        if skip_base and module in _BASE:      # the base's own, as path_choice left it (packed or not)
            continue
        if _PACKED.get(module, (None,))[0] == (w.data_ptr(), w._version):   # packed already, weights unchanged
            continue
        bias = None if dtype == torch.float32 else (module.bias.detach() if module.bias is not None
                                                     else w.new_zeros(w.shape[0])).to(dtype)
        _PACKED[module] = ((w.data_ptr(), w._version), torch.ops.mkldnn._reorder_linear_weight(w.detach().to(dtype)),
                           bias)
        module.forward = types.MethodType(_packed_forward, module)
        n += 1
    return n


def unpack_linears(model: nn.Module) -> None:
    for module in model.modules():
        if "forward" in vars(module) and getattr(module.forward, "__func__", None) is _packed_forward:
            _PACKED.pop(module, None)
            del module.forward                      # the class's forward again


# -- 2) grouped-query attention without repeat_kv -------------------------------------------------
_TILED: list = []      # [(mask, n_rep, tiled)]: the last tiling, reused by every layer of a forward


def _tiled_mask(mask: torch.Tensor, n_rep: int) -> torch.Tensor:
    """mask [., 1, N, K] repeated n_rep times along the rows; every layer of one forward gets the same mask
    object, so it is tiled once per forward, not once per layer. (Masks are built afresh for each forward and
    never changed in place; inference tensors have no version counter to check that.)"""
    if _TILED and _TILED[0][0] is mask and _TILED[0][1] == n_rep:
        return _TILED[0][2]
    tiled = mask.repeat(1, 1, n_rep, 1)
    _TILED[:] = [(mask, n_rep, tiled)]
    return tiled


def sdpa_gqa_folded(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """query [B, H, N, d], key/value [B, H_kv, K, d], attention_mask [B|1, 1, N, K] -> ([B, N, H, d], None)."""
    n_rep = getattr(module, "num_key_value_groups", 1)
    B, H, N, d = query.shape
    if (n_rep == 1 or N == 1 or attention_mask is None or attention_mask.dim() != 4 or dropout
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    H_kv = H // n_rep
    q = query.reshape(B, H_kv, n_rep * N, d)                       # head h = g*n_rep + r -> row r*N + i of group g
    mask = _tiled_mask(attention_mask, n_rep)                      # [., 1, n_rep*N, K], rows in the same order
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)   # [B, H_kv, n_rep*N, dv]
    out = out.reshape(B, H, N, value.shape[-1]).transpose(1, 2).contiguous()
    return out, None


AttentionInterface.register(GQA_FOLDED, sdpa_gqa_folded)
AttentionMaskInterface.register(GQA_FOLDED, sdpa_mask)


def use_folded_gqa(model) -> bool:
    """Switch a model running SDPA attention to sdpa_gqa_folded; False when it runs something else."""
    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", GQA_FOLDED):
        return False
    model.set_attn_implementation(GQA_FOLDED)
    return True


def prepare_heads_for_decoding(heads, bf16: bool | None = None) -> int:
    """Packed linears for draft heads too (blocks, own LM heads, the Hydra++ prefix layer, and the frozen
    draft-vocabulary LM heads they end in): drafting runs a few of these 1-2 row products per step, each
    bound by reading its weights, from memory since the base model's step has evicted them from the caches.
    bf16 (None: where the CPU multiplies bf16 in hardware, AVX512-BF16/AMX) packs them in bfloat16, which
    halves the bytes read (a 4096 x 576 draft LM head, 1 row, from memory: 0.40 -> 0.23 ms on AMX). Only
    the drafts change, never the output: verification is the base model's, in float32. A linear the base
    model owns (own_linears, which prepare_for_decoding calls) stays as it is. Returns how many."""
    if bf16 is None:
        bf16 = cpu_has_fast_bf16()
    dtype = torch.bfloat16 if bf16 else torch.float32
    n = pack_linears(heads, dtype, skip_base=True)
    if hasattr(heads, "output_layers"):
        n += sum(pack_linears(layer, dtype, skip_base=True) for layer in heads.output_layers())
    return n
