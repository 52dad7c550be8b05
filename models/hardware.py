"""This machine: what its CPU can do (training's precision, decoding's weight dtype), the host settings decoding
on a GPU runs with, and its description for every record that times something (machine_description)."""
from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# the instruction sets that change which kernels run (and so a step's time and, in bf16, its rounding)
CPU_KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "asimd", "sve")


def cpu_has_fast_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX).

    `cpuinfo`: the text of a Linux /proc/cpuinfo to read the flags from (tests pass one). Without it torch's
    own probe answers (any OS), and /proc/cpuinfo where this torch has no probe.
    """
    if cpuinfo is None:
        probes = [getattr(torch.cpu, f"_is_{name}_supported", None) for name in ("avx512_bf16", "amx_tile")]
        if any(p is not None for p in probes):
            return any(p() for p in probes if p is not None)
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
    return any(f in flags for f in CPU_BF16_FLAGS)


# -- host settings for decoding on a GPU -------------------------------------------------------------------------
# A decode step on a GPU is host-bound: a 7B Llama-shaped bf16 model (random weights) on an H100, torch 2.11, our
# plain step at torch's defaults (16 host threads, cuDNN attention) took 61 ms, at 1 host thread 20 ms, at 1 thread
# with cuDNN attention off 22.5 ms; a Medusa-1 step on the 63-node tree 128 -> 24 -> 23 ms. cuDNN's attention plans
# anew for every new key length (38 ms of host time a forward at the defaults), so a tree step paid it twice over.
# With cuDNN attention off the tree step stays at ~1.04x a plain step whatever the thread count (reports/bench/
# gpu_h100_2026-11-26.json). On a CPU these settings change nothing: its threads are the stage's own setting.
# static_step: the fixed-shape step replayed as CUDA graphs (models/engine/static_step.py): 9.8 ms a 7B plain step on
# an H100 against 20.2 eager, but off by default: its bf16 greedy output left the eager step's at a margin beyond the
# tie rule on a random 7B (docs/engine.md).
CUDA_HOST_DEFAULTS = {"threads": 1, "cudnn_attention": False, "static_step": False}
HOST_SETTINGS: dict = {}         # what apply_host_settings chose last in this process: a record (host_record), which
                                 # nothing decodes by (the stages pass the static step: pipelines/host.py static_step)


def is_cuda(device) -> bool:
    """Whether `device` (a string or torch.device) is a CUDA device: the one check the host settings depend on."""
    return str(device).startswith("cuda")


def choose_host_settings(device, threads="default", cudnn_attention="default", static_step="default") -> dict:
    """The host settings for decoding on `device`: {} on a CPU; on CUDA {"threads", "cudnn_attention",
    "static_step"}, each the value given, CUDA_HOST_DEFAULTS' for "default", or left out for None (torch's own
    stays; no static step)."""
    if not is_cuda(device):
        return {}
    chosen = {}
    for key, value in (("threads", threads), ("cudnn_attention", cudnn_attention), ("static_step", static_step)):
        value = CUDA_HOST_DEFAULTS[key] if value == "default" else value
        if value is None:
            continue
        if key == "threads" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"host threads={value!r}: use a whole number >= 1, or null to leave torch's own")
        if key in ("cudnn_attention", "static_step") and not isinstance(value, bool):
            raise ValueError(f"host {key}={value!r}: use true, false, or null to leave torch's own")
        chosen[key] = value
    return chosen


def apply_host_settings(device, threads="default", cudnn_attention="default", static_step="default") -> dict:
    """Choose (choose_host_settings) and set the host settings for decoding on `device`; -> host_record(device).
    Call it after the stage has set its own CPU threads: on CUDA the host settings win. static_step is only
    recorded here: the stages pass it to the decoder themselves (pipelines/host.py static_step)."""
    chosen = choose_host_settings(device, threads, cudnn_attention, static_step)
    if "threads" in chosen:
        torch.set_num_threads(chosen["threads"])
    if "cudnn_attention" in chosen:
        torch.backends.cuda.enable_cudnn_sdp(chosen["cudnn_attention"])
    HOST_SETTINGS.clear()
    HOST_SETTINGS.update(chosen)
    return host_record(device)


def applied_host_settings(device) -> dict:
    """The host settings apply_host_settings set for `device` in this process ({} on a CPU: nothing changed)."""
    return dict(HOST_SETTINGS) if is_cuda(device) else {}


def host_record(device) -> dict:
    """What a timed step ran under, for its metrics: device, torch and CUDA versions, the host settings this
    process applied ({} on a CPU: nothing changed) and the state they left (threads, attention backends)."""
    cuda = torch.backends.cuda
    record = {"device": str(device), "gpu": None, "torch": torch.__version__, "cuda": torch.version.cuda,
              "host_settings": applied_host_settings(device),
              "torch_threads": torch.get_num_threads(),
              "omp_wait": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},   # libgomp read them
              "sdp_backends": {"cudnn": cuda.cudnn_sdp_enabled(), "flash": cuda.flash_sdp_enabled(),
                               "mem_efficient": cuda.mem_efficient_sdp_enabled(), "math": cuda.math_sdp_enabled()}}
    if torch.device(device).type == "cuda" and torch.cuda.is_available():   # the device itself, not the host rule
        record["gpu"] = torch.cuda.get_device_name(torch.device(device))
        record["cudnn_version"] = torch.backends.cudnn.version()
    return record


# -- the machine, described once for every record that times something ------------------------------------------

def cpu_model() -> str:
    """The CPU's marketing name where the OS tells it (Linux /proc/cpuinfo), else platform's guess."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description(device: str = "cpu") -> dict:
    info = {"platform": platform.platform(), "processor": cpu_model(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "device": device}
    if applied_host_settings(device):              # models.hardware, on CUDA (a CPU's description is unchanged)
        info["host_settings"] = applied_host_settings(device)
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def machine_label(device: str) -> str:
    """A short name for tables: the GPU's, or "<n>-core CPU (<arch>)"."""
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(0)} GPU"
    return f"{os.cpu_count()}-core CPU ({platform.machine()})"


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """Which of CPU_KERNEL_FLAGS this CPU has (Linux /proc/cpuinfo; [] where the OS does not tell)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
    have = set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            have.update(line.split(":", 1)[-1].split())
    return [f for f in CPU_KERNEL_FLAGS if f in have]
