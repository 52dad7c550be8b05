"""Latency profile of the verify step: the decoder's own step (models.engine.decoding.decode_step) over n tree
tokens, relative to a 1-token step.

    prof = verify_latency_profile(model, sizes=[1, 4, 8, 16, 32, 64], repeats=7, prefix_len=300)
    prof["relative"][i]   # (forward + LM head of a step of n tokens) / (the same for n = 1, the baseline's step)
    batch = batch_verify_profile(model, batch_sizes=[1, 2, 4, 8], sizes=[1, 4, 16, 64])   # seconds[B][n], batched

Each size is a FixedDrafter proposing n - 1 random tokens as a chain below the root, after a
prefix_len-token random prompt; decoding.time_step takes the step and rewinds it. n = 1 is the
baseline's plain step. The LM head runs on the rows the acceptance rule reads (all of them up to
acceptance.EAGER_ROWS tokens), as in decoding. Sizes are interleaved within each repeat so that a
slow phase of a shared machine hits every size alike. static: the steps run as the decoder runs them with the
static step (models/engine/static_step.py: CUDA graphs on CUDA); the calibrate stage passes its host setting
(pipelines/host.py static_step), so that a calibrated tree is chosen for the step that evaluate will take.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np
import torch

from models.engine.acceptance import SamplingConfig
from models.engine.decoding import prefill, time_step
from models.engine.drafting import DraftContext, FixedDrafter
from models.engine.static_step import attach_static


@torch.inference_mode()
def verify_latency_profile(model, sizes=(1, 4, 8, 16, 32, 64), repeats: int = 7, prefix_len: int = 300,
                           seed: int = 0, static: bool = False) -> dict:
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(model.config.vocab_size, (1, prefix_len), generator=g).to(device)
    state = prefill(model, ids, SamplingConfig())
    sizes = [int(n) for n in sizes]
    if static:                                          # time_step rewinds each step: the cache never grows
        attach_static(state, None, max_new_tokens=max(sizes))
    drafters = {n: FixedDrafter(torch.randint(model.config.vocab_size, (n - 1,), generator=g)) for n in sizes}
    for drafter in drafters.values():
        drafter.start(DraftContext(ids[0], None, SamplingConfig()))
    fwd = {n: [] for n in sizes}
    full = {n: [] for n in sizes}
    for rep in range(repeats + 1):                      # round 0 warms up
        for n in sizes:
            parts = time_step(state, drafters[n], max_depth=n, repeats=1, warmup=0)[0]
            if rep:
                fwd[n].append(parts["verify"] - parts["lm_head"])
                full[n].append(parts["verify"])
    med_fwd = [statistics.median(fwd[n]) for n in sizes]
    med_full = [statistics.median(full[n]) for n in sizes]
    one = med_full[sizes.index(1)] if 1 in sizes else med_full[0]
    return {"sizes": sizes, "prefix_len": prefix_len, "repeats": repeats, "statistic": "median", "static": bool(static),
            "forward_s": med_fwd, "forward_lm_head_s": med_full,
            "relative": [t / one for t in med_full], "relative_forward": [t / one for t in med_fwd],
            "all_forward_lm_head_s": [full[n] for n in sizes]}


@torch.inference_mode()
def batch_verify_profile(model, batch_sizes=(1, 2, 4, 8), sizes=(1, 4, 16, 64), repeats: int = 5,
                         prefix_len: int = 300, seed: int = 0) -> dict:
    """The batched verify step as the engine takes it (decoding.verify_rows: step.verify with its own row masks, a
    lone row's 1-token step maskless as a plain step is): B rows, each a chain of n tokens after its own
    prefix_len-token prompt, in one forward with the LM head on every row; median seconds [len(batch_sizes)][len(
    sizes)], sizes interleaved within each repeat. Eager (a batch takes no static step)."""
    from types import SimpleNamespace

    from models.engine.decoding import Row, prefill_rows, verify_rows
    from models.engine.trees import TreeBuffers, chain_tree

    device, vocab = next(model.parameters()).device, model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    chains = {int(n): TreeBuffers.build(chain_tree(int(n) - 1)) for n in sizes if int(n) > 1}
    seconds = []
    for B in [int(b) for b in batch_sizes]:
        prompts = [torch.randint(vocab, (prefix_len,), generator=g).to(device) for _ in range(B)]
        state = prefill_rows(model, prompts, SamplingConfig(), [Row(0, 0) for _ in range(B)], [None] * B)
        times = {int(n): [] for n in sizes}
        for rep in range(repeats + 1):                                   # round 0 warms up
            for n in times:
                drafts = [None if n == 1 else SimpleNamespace(buf=chains[n], tokens=torch.randint(
                    vocab, (n,), generator=g).to(device)) for _ in range(B)]
                t0 = time.perf_counter()
                hidden = verify_rows(state, drafts)                                        # [B, n, h]
                state.base_logits(hidden.reshape(B * n, -1))
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if rep:
                    times[n].append(time.perf_counter() - t0)
                state.cache.crop(-n)
        seconds.append([statistics.median(times[int(n)]) for n in sizes])
    return {"batch_sizes": [int(b) for b in batch_sizes], "sizes": [int(n) for n in sizes], "prefix_len": prefix_len,
            "repeats": repeats, "statistic": "median", "seconds": seconds}


@torch.inference_mode()
def weight_read_seconds(model, repeats: int = 7) -> dict:
    """The floor a decoding step cannot beat on a memory-bound machine: one pass reading every weight of the model
    once (a sum over each parameter, shared ones once), median of repeats -> {"seconds", "bytes", "gb_per_s"}."""
    params = list({p.data_ptr(): p for p in model.parameters()}.values())
    size = sum(p.numel() * p.element_size() for p in params)
    device = params[0].device
    times = []
    for rep in range(repeats + 1):                                       # round 0 warms up
        t0 = time.perf_counter()
        total = sum(float(p.sum()) for p in params)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if rep:
            times.append(time.perf_counter() - t0)
    del total
    seconds = statistics.median(times)
    return {"seconds": seconds, "bytes": size, "gb_per_s": size / seconds / 1e9}


def train_step_seconds(model, positions: int = 128, repeats: int = 2, bf16: bool | None = None) -> dict:
    """The compute-bound unit the train stages scale with: one forward and backward of the whole base over one
    sequence of `positions` tokens, its LM head included, under the autocast a CPU trainer picks here (bf16 where
    the CPU multiplies bf16 in hardware, else float32), median of repeats -> {"seconds", "positions", "dtype"}.
    A plain step is memory-bound and does not follow a machine's matmul throughput, which training does."""
    from models.hardware import cpu_has_fast_bf16

    device = next(model.parameters()).device
    if bf16 is None:
        bf16 = device.type == "cuda" or cpu_has_fast_bf16()
    ids = torch.randint(0, int(model.config.vocab_size), (1, positions), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    grads = {p: p.requires_grad for p in model.parameters()}
    times = []
    try:
        for p in model.parameters():                                  # the weights' gradients, as Medusa-2's
            p.requires_grad_(True)                                    # joint stage computes them
        for rep in range(repeats + 1):                                # round 0 warms up
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = model(input_ids=ids, use_cache=False).logits
            logits.float().logsumexp(-1).mean().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if rep:
                times.append(time.perf_counter() - t0)
    finally:
        for p, g in grads.items():
            p.grad = None
            p.requires_grad_(g)
    return {"seconds": statistics.median(times), "positions": positions, "dtype": "bf16" if bf16 else "float32"}


def interpolate_cost(sizes: Sequence[int], seconds: Sequence[float], n: float) -> float:
    """Piecewise-linear in the number of tokens; linear extrapolation from the last two points beyond."""
    x, y = np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float)
    order = np.argsort(x)
    x, y = x[order], y[order]
    if n > x[-1] and len(x) > 1:
        return float(y[-1] + (n - x[-1]) * (y[-1] - y[-2]) / (x[-1] - x[-2]))
    return float(np.interp(n, x, y))


def relative_step_costs(sizes, seconds, baseline_s: float, max_tokens: int) -> list[float]:
    """Cost of a step verifying m = 1..max_tokens tokens relative to the baseline's 1-token step: the profile
    (sizes [n], seconds [n]) interpolated by interpolate_cost."""
    if not len(sizes) or min(int(n) for n in sizes) != 1:
        raise ValueError(f"the latency profile must start at 1 token, got sizes {list(sizes)}")
    return [interpolate_cost(sizes, seconds, m) / baseline_s for m in range(1, max_tokens + 1)]
