"""Tolerances derived from the dtype and the size of the reductions, for comparing two computations of the same
values whose kernels sum in other orders (batched against row by row; oneDNN picks kernels by shape and CPU).

Summing n products in two orders differs by at most about n * eps * (sum of |products|) (recursive summation's
bound, gamma_n ~ n * u); `scale` stands for that sum's size (the compared values' magnitude), and each of
`chained` reductions in sequence (layers, depths) can add its own. The bound is a worst case: a comparison
that needs more is a real difference, not rounding.
"""
from __future__ import annotations

import torch


def reduction_tolerance(dtype: torch.dtype, reduction: int, scale: float, chained: int = 1) -> dict:
    """assert_close keyword arguments for values of magnitude `scale` that went through `chained` reductions of
    at most `reduction` terms each, in `dtype`."""
    atol = chained * reduction * torch.finfo(dtype).eps * float(scale)
    return {"rtol": 0.0, "atol": atol}
