"""What one decode step spends, host and device: torch.profiler over two greedy decodes of the same prompt, one of
a single new token and one of n, their difference per token (so the prompt's forward cancels out).

    decode = lambda k: generate(model, None, prompt, max_new_tokens=k, stop_token_ids=[])
    prof = step_profile(decode, device, n=64)
    prof["wall_ms"], prof["device_busy_ms"], prof["kernels"], prof["launches"], prof["top_kernels"]

It compares two decoders that run the same model, ours and transformers' compiled static-cache generate. Where
the wall time a token is above the kernel time, the rest is host time or gaps between launches. Where the kernel
time itself differs, the kernels differ: torch.compile generates fused kernels, and our static step replays the
eager ones. A kernel launched from a replayed CUDA graph is still recorded as a kernel, while its launch is one
cudaGraphLaunch. On a CPU there are no device kernels, and only wall_ms is measured.
"""
from __future__ import annotations

import statistics
import time
from collections import Counter
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from models.measure.draft_profile import LAUNCHES, device_sync


def _timed(decode: Callable[[int], object], k: int, device: torch.device) -> float:
    device_sync(device)
    t0 = time.perf_counter()
    decode(k)
    device_sync(device)
    return time.perf_counter() - t0


def _profiled(decode: Callable[[int], object], k: int, device: torch.device) -> tuple[Counter, Counter, int]:
    """(kernel time by name in µs, kernel count by name, launches) of one decode of k tokens."""
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        decode(k)
        device_sync(device)
    time_us, count = Counter(), Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            time_us[e.name] += e.device_time
            count[e.name] += 1
    launches = sum(e.count for e in prof.key_averages() if e.key in LAUNCHES)
    return time_us, count, launches


def step_profile(decode: Callable[[int], object], device: torch.device | str, n: int = 64, repeats: int = 3,
                 top: int = 12) -> dict:
    """decode(k) runs one greedy decode of exactly k new tokens. Per token, from decodes of 1 and n tokens (each
    warmed up first, so a compile or a capture is not counted): wall_ms (median of `repeats` synchronised timings),
    and on CUDA device_busy_ms (summed kernel time), kernels (kernels run), launches (kernel and graph launches
    from the host) and top_kernels (name -> [ms, count] a token, the `top` longest)."""
    if n < 2:
        raise ValueError(f"n={n}: the per-token figures are the difference of decodes of 1 and n tokens; use n >= 2")
    device = torch.device(device)
    for k in (1, n):
        decode(k)                                     # warm-up: compiles, captures, allocations
    steps = n - 1
    walls = [(_timed(decode, n, device) - _timed(decode, 1, device)) / steps for _ in range(repeats)]
    out = {"tokens": n, "wall_ms": round(1e3 * statistics.median(walls), 4), "device_busy_ms": None, "kernels": None,
           "launches": None, "top_kernels": None}
    if device.type != "cuda":
        return out
    (t1, c1, l1), (tn, cn, ln) = _profiled(decode, 1, device), _profiled(decode, n, device)
    per_us = {k: (tn[k] - t1.get(k, 0.0)) / steps for k in tn}
    per_count = {k: (cn[k] - c1.get(k, 0)) / steps for k in cn}
    ranked = sorted(per_us, key=per_us.get, reverse=True)[:top]
    out.update(device_busy_ms=round((sum(tn.values()) - sum(t1.values())) / 1e3 / steps, 4),
               kernels=round((sum(cn.values()) - sum(c1.values())) / steps, 1), launches=round((ln - l1) / steps, 1),
               top_kernels={k[:120]: [round(per_us[k] / 1e3, 4), round(per_count[k], 2)] for k in ranked})
    return out
