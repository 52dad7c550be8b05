"""LM-head products for few rows, fast on a CPU: the baseline step, the verify step and the draft heads.

    logits = project(model.get_output_embeddings(), hidden)     # hidden [R, h] -> [R, V], = linear(hidden)

A 49152 x 576 LM head is a fifth of SmolLM2's weights, and nn.Linear's x @ W.T runs badly on MKL
for a handful of rows. Measured on this 2-core CPU (1 thread, ms, median):

    rows        1     4     10    22    64
    nn.Linear   19    31    39    63    119
    W @ x.T     17    13    46    76    106
    oneDNN      14    20    25    36    81     (weights packed once, torch._C._nn.mkldnn_linear)

so up to 8 rows go as W @ x.T (one row as two columns) and more rows through oneDNN with a packed
copy of the weights (cached per layer, re-packed if the weights change). Other devices, dtypes
and modules use the module itself.
"""
from __future__ import annotations

import weakref

import torch

from models.engine.fast_inference import is_packed

SMALL_BATCH = 8
_packed: "weakref.WeakKeyDictionary[torch.nn.Linear, tuple]" = weakref.WeakKeyDictionary()


def _onednn_weights(linear: torch.nn.Linear):
    """(mkldnn weight, mkldnn bias) of linear, packed once per weight version; None where oneDNN is missing."""
    w = linear.weight
    key = (w.data_ptr(), w._version)
    hit = _packed.get(linear)
    if hit is not None and hit[0] == key:
        return hit[1]
    try:
        bias = linear.bias if linear.bias is not None else torch.zeros(w.shape[0], dtype=w.dtype)
        packed = (w.detach().to_mkldnn(), bias.detach().to_mkldnn())
    except (RuntimeError, AttributeError):
        packed = None
    _packed[linear] = (key, packed)
    return packed


def project(linear, x: torch.Tensor) -> torch.Tensor:
    """linear(x) for x [R, h] -> [R, V] (same values up to float rounding)."""
    if is_packed(linear):                       # prepared by models.engine.fast_inference: its own fast path
        return linear(x.to(linear.weight.dtype))
    if not (isinstance(linear, torch.nn.Linear) and x.device.type == "cpu" and linear.weight.dtype == torch.float32):
        return linear(x)
    x = x.to(torch.float32)
    R = x.shape[0]
    if R <= SMALL_BATCH:
        cols = torch.cat([x, x]) if R == 1 else x
        out = (linear.weight @ cols.T)[:, :R].T                               # [R, V], a column-major view
        return out if linear.bias is None else out + linear.bias
    packed = _onednn_weights(linear)
    if packed is None:
        return linear(x)
    return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), *packed).to_dense()
