"""Latency profile of the verify step: one base forward over n tree tokens, relative to a 1-token step.

    prof = verify_latency_profile(model, sizes=[1, 4, 8, 16, 32, 64], repeats=7, prefix_len=300)
    prof["relative"][i]   # (forward + LM head over n rows) / (the same for n = 1, the baseline's step)

Runs the decoder's own verify call (models.decoding.verify_tree: 4-D additive mask, position ids =
past + depth) on a random prefix_len-token cache, cropped back after each call. Sizes are
interleaved within each repeat so that a slow phase of a shared machine hits every size alike.
"""
from __future__ import annotations

import statistics
import time

import torch

from models.decoding import verify_tree
from models.kv_cache import new_cache
from models.projection import project
from models.trees import TreeBuffers, chain_tree


@torch.inference_mode()
def verify_latency_profile(model, sizes=(1, 4, 8, 16, 32, 64), repeats: int = 7, prefix_len: int = 300,
                           seed: int = 0) -> dict:
    device, dtype = next(model.parameters()).device, model.dtype
    decoder, lm_head = model.get_decoder(), model.get_output_embeddings()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(model.config.vocab_size, (1, prefix_len), generator=g).to(device)
    cache = new_cache()
    decoder(input_ids=ids, past_key_values=cache, use_cache=True)
    sizes = [int(n) for n in sizes]
    bufs = {n: TreeBuffers.build(chain_tree(n - 1, topk=1)) for n in sizes}   # any n-token tree: same forward
    toks = {n: torch.randint(model.config.vocab_size, (n,), generator=g).to(device) for n in sizes}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fwd = {n: [] for n in sizes}
    full = {n: [] for n in sizes}
    for rep in range(repeats + 1):                      # round 0 warms up
        for n in sizes:
            sync()
            t0 = time.perf_counter()
            hidden = verify_tree(decoder, toks[n], bufs[n], cache, prefix_len, dtype)   # [n, h]
            sync()
            t1 = time.perf_counter()
            project(lm_head, hidden).argmax(-1)
            sync()
            t2 = time.perf_counter()
            cache.crop(-n)
            if rep:
                fwd[n].append(t1 - t0)
                full[n].append(t2 - t0)
    med_fwd = [statistics.median(fwd[n]) for n in sizes]
    med_full = [statistics.median(full[n]) for n in sizes]
    one = med_full[sizes.index(1)] if 1 in sizes else med_full[0]
    return {"sizes": sizes, "prefix_len": prefix_len, "repeats": repeats, "statistic": "median",
            "forward_s": med_fwd, "forward_lm_head_s": med_full,
            "relative": [t / one for t in med_full], "relative_forward": [t / one for t in med_fwd],
            "all_forward_lm_head_s": [full[n] for n in sizes]}
