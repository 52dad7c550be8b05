"""OpenMP's wait policy for the commands that decode: imported by them before torch.

torch's CPU build runs its threads on libgomp, which reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once, when it is
loaded (at `import torch`). Left alone, a libgomp thread with nothing to do spins for 300,000 iterations
(milliseconds) before it sleeps: on an idle core that saves a wake-up per parallel region, but on cores shared
with other processes the spinning threads take the time the decoding thread needs, at every one of the hundreds
of parallel regions of a step (more in a tree step than in a 1-token one). So evaluate, generate, calibrate and
the benchmarks import this module first (`from pipelines import omp` above `import torch`); the training and data
stages keep libgomp's defaults. `python -m pipelines.bench.load` measures the policies side by side.

A variable already in the environment wins (`OMP_WAIT_POLICY=ACTIVE python -m pipelines.evaluate ...`), and
PIPELINES_OMP=off leaves libgomp's defaults. Importing this after torch changes nothing for the running process
(only for the processes it starts).
"""
from __future__ import annotations

import os

# Sleep at once (libgomp's spin count 0). pipelines.bench.load, SmolLM2, 520-token prompt, 64 new tokens, random
# heads, 2-core AMD EPYC already running a 2-thread distill job, 2026-11-25; ms per step, libgomp's default ->
# PASSIVE: baseline 430 -> 136, hydra_pp/optimal_pld 1079 -> 260, medusa1/sparse64 3467 -> 508; with two more
# stock torch processes (2 + 1 threads) beside it 3421 -> 421, 5068 -> 1025, 8648 -> 1625. GOMP_SPINCOUNT=10000
# landed in between (266 / 447 / 954 and 1063 / 1610 / 3428); one thread instead of two did no better than two.
OMP_POLICY = {"OMP_WAIT_POLICY": "PASSIVE"}
OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")      # either one set by the user: OMP_POLICY is not applied
SWITCH = "PIPELINES_OMP"          # "off": leave libgomp's defaults (bench_load's `default` setting)


def omp_defaults(environ) -> dict[str, str]:
    """The OpenMP variables to add to `environ`: OMP_POLICY, unless the environment sets OMP_WAIT_POLICY or
    GOMP_SPINCOUNT itself or says PIPELINES_OMP=off."""
    if environ.get(SWITCH, "").lower() == "off" or any(k in environ for k in OMP_VARS):
        return {}
    return dict(OMP_POLICY)


os.environ.update(omp_defaults(os.environ))
