"""OpenMP's wait policy for the commands that decode: imported by them before torch.

torch's CPU build runs its threads on libgomp, which reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once, when it is
loaded (at `import torch`). Left alone, a libgomp thread with nothing to do spins for 300,000 iterations
(milliseconds) before it sleeps. On cores of its own that saves a wake-up at each of the hundreds of parallel
regions of a step; on cores shared with other processes the spinning threads take the time the decoding thread
needs. So the policy follows the machine as the command starts: with nothing else runnable (Linux's
procs_running, sampled for a fifth of a second) libgomp keeps its default; with other threads wanting the cores,
OMP_WAIT_POLICY=PASSIVE (sleep at once). evaluate, generate, calibrate and the benchmarks import this module
first (`from pipelines import omp` above `import torch`); the training and data stages keep libgomp's defaults.
`python -m pipelines.bench.load` measures the policies side by side, quiet and loaded. CHOSEN says what was
chosen and why; run records carry it (models.hardware.host_record reads the environment).

A variable already in the environment wins (`OMP_WAIT_POLICY=ACTIVE python -m pipelines.evaluate ...`), and
PIPELINES_OMP=off leaves libgomp's defaults, PIPELINES_OMP=passive sleeps at once whatever the load. Importing
this after torch changes nothing for the running process (only for the processes it starts).
"""
from __future__ import annotations

import os
import time

# Sleep at once on a busy machine. pipelines.bench.load, SmolLM2, 520-token prompt, 64 new tokens, random
# heads, 2-core AMD EPYC already running a 2-thread distill job, 2026-11-25; ms per step, libgomp's default ->
# PASSIVE: baseline 430 -> 136, hydra_pp/optimal_pld 1079 -> 260, medusa1/sparse64 3467 -> 508; with two more
# stock torch processes (2 + 1 threads) beside it 3421 -> 421, 5068 -> 1025, 8648 -> 1625. GOMP_SPINCOUNT=10000
# landed in between (266 / 447 / 954 and 1063 / 1610 / 3428); one thread instead of two did no better than two.
# But on a quiet machine PASSIVE costs time, and more to the baseline than to a tree step, so it flattered the
# speedups: `make bench-wait OVERRIDES=heads=hydra_pp`, 2-core AMD EPYC (AVX2), nothing else running, 2026-11-28,
# ms per step over libgomp's default, 15 pairs: baseline x1.336 [1.254, 1.422], Hydra++ on 15 nodes x1.280
# [1.230, 1.332] (ACTIVE: x1.056, x1.041).
OMP_POLICY = {"OMP_WAIT_POLICY": "PASSIVE"}           # applied on a busy machine
OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")      # either one set by the user: nothing is applied
SWITCH = "PIPELINES_OMP"          # "off": libgomp's defaults (bench_load's `default` setting); "passive": OMP_POLICY
BUSY_AT = 0.5                     # other runnable threads, on average, from which the machine counts as busy


def other_runnable(samples: int = 10, interval: float = 0.02, stat: str = "/proc/stat") -> float | None:
    """How many threads besides this one want a core right now: the mean of Linux's procs_running (which counts
    this process too) over `samples` reads; None where the OS does not tell."""
    counts = []
    for i in range(samples):
        try:
            with open(stat) as f:
                counts += [int(line.split()[1]) for line in f if line.startswith("procs_running")]
        except (OSError, ValueError, IndexError):
            return None
        if i + 1 < samples:
            time.sleep(interval)
    return max(0.0, sum(counts) / len(counts) - 1) if counts else None


def omp_defaults(environ, others: float | None = None) -> dict[str, str]:
    """The OpenMP variables to add to `environ`: OMP_POLICY on a busy machine (`others` runnable threads besides
    this one at BUSY_AT or more, or PIPELINES_OMP=passive), none on a quiet one, none where the environment sets
    OMP_WAIT_POLICY or GOMP_SPINCOUNT itself or says PIPELINES_OMP=off."""
    decided = user_decided(environ)
    if decided is not None:
        return decided
    return dict(OMP_POLICY) if others is not None and others >= BUSY_AT else {}


def user_decided(environ) -> dict[str, str] | None:
    """What the environment decides whatever the load (the variables to add), or None where the load decides."""
    switch = environ.get(SWITCH, "").lower()
    if switch == "off" or any(k in environ for k in OMP_VARS):
        return {}
    return dict(OMP_POLICY) if switch == "passive" else None


def choose(environ) -> dict:
    """Add the policy for this machine as it is now to `environ`; returns what was chosen and why. The load is
    sampled only where the environment leaves the choice to it."""
    others = None if user_decided(environ) is not None else other_runnable()
    added = omp_defaults(environ, others)
    environ.update(added)
    return {"other_runnable": None if others is None else round(others, 2), "added": added,
            "policy": environ.get("OMP_WAIT_POLICY", "libgomp default")}


CHOSEN = choose(os.environ)
