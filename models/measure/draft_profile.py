"""Where a drafter's time goes: torch.profiler over its draft() alone, repeated from one decoding state.

    prof = draft_profile(model, drafter, prompt_ids, repeats=20)
    prof["wall_ms"], prof["device_busy_ms"], prof["kernels"], prof["top_host_ops"]

A draft is host-bound when its wall time is well above the time the device spends in kernels
(device_busy_ms): the difference is Python, dispatch and launch overhead, which a faster device does
not shrink. On a CPU there are no device kernels, and device_busy_ms and kernels are None.
"""
from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from models.engine.acceptance import SamplingConfig
from models.engine.decoding import prefill

# a replayed CUDA graph is one launch (cudaGraphLaunch) however many kernels it holds
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")


def device_sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so a wall clock reads finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def draft_profile(model, drafter, prompt_ids, repeats: int = 20, max_depth: int = 64, top: int = 8,
                  static_drafts: bool = False) -> dict:
    """Per draft, averaged over `repeats` drafts of the same root (draft() does not move the drafter on), the
    drafts replayed as CUDA graphs where static_drafts says so (and the drafter can):
    wall_ms (synchronised), device_busy_ms (summed kernel time), kernels (launches), top_host_ops (the ops
    with the most host self time, ms a draft) and host_ops (aten ops dispatched)."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: profile at least one draft")
    device = next(model.parameters()).device
    ids = torch.as_tensor(prompt_ids, device=device).reshape(1, -1)
    state = prefill(model, ids, SamplingConfig(), None, drafter, static_drafts=static_drafts)
    drafter.draft(state.root, max_depth)                    # warm-up, outside the profile
    device_sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        drafter.draft(state.root, max_depth)
    device_sync(device)
    wall = (time.perf_counter() - t0) / repeats
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            drafter.draft(state.root, max_depth)
        device_sync(device)
    events = prof.key_averages()
    host = sorted((e for e in events if e.key.startswith("aten::")), key=lambda e: e.self_cpu_time_total,
                  reverse=True)
    out = {"repeats": repeats, "wall_ms": round(1e3 * wall, 4),
           "host_ops": round(sum(e.count for e in host) / repeats, 1),
           "top_host_ops": {e.key: round(e.self_cpu_time_total / 1e3 / repeats, 4) for e in host[:top]},
           "device_busy_ms": None, "kernels": None}
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        out["device_busy_ms"] = round(sum(e.device_time for e in kernels) / 1e3 / repeats, 4)
        out["kernels"] = round(sum(e.count for e in events if e.key in LAUNCHES) / repeats, 1)
    return out
