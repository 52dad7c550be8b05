"""What this machine's CPU can do, asked once by training (which precision) and decoding (which weight dtype)."""
from __future__ import annotations

from pathlib import Path

import torch

CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


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
