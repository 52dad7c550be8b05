"""Step-by-step conformance of our decoder with the authors' code (docs/conformance.md): our steps recorded as the
official loop records its own, and the two compared step by step. The drafts compared come from a seed, in each
method's package (models/methods/medusa/seeded.py, models/methods/eagle/seeded.py).

    rec = record_steps(model, drafter, ids, max_new_tokens=64, eos_token_id=tok.eos_token_id)
    rec["steps"]          # per step [root, accepted drafts...]: the tokens it appends, as 0.1 and HEAD append them
    compare_steps(ours["steps"], official["steps"])   # {"compared", "identical", "first_mismatch"}
    tree = paths_tree("eagle_mc_sim_7b_63", paths)                   # a static tree given by its paths

The official loop (medusa_generate) appends, per step, the root (the base model's token from the step before)
and the drafts it accepted, and stops after the step whose tokens reach the limit or contain EOS; record_steps
runs our decode step (models/engine/decoding.py) under that same stop rule, the tree never cut near the limit.
"""
from __future__ import annotations

import time

import torch

from models.engine.decoding import SamplingConfig, decode_step, prefill
from models.engine.trees import TreeSpec


def paths_tree(name: str, paths, top_k: int = 10) -> TreeSpec:
    """A static tree from its paths of ranks (as the authors' tree_choices lists hold them)."""
    return TreeSpec(name, tuple(tuple(int(r) for r in p) for p in paths), top_k=top_k)


@torch.inference_mode()
def record_steps(model, drafter, ids: list[int], max_new_tokens: int, eos_token_id: int | None) -> dict:
    """Greedy decoding of `ids` with `drafter`, stopped as the official loop stops -> {"steps": [[root, drafts...]],
    "new_tokens", "seconds"} (seconds: prefill included)."""
    t0 = time.perf_counter()
    state = prefill(model, torch.tensor([ids]), SamplingConfig(), None, drafter)
    steps, emitted = [], 0
    depth = drafter.buf.spec.depth          # the whole tree at every step (a TreeDrafter)
    while emitted < max_new_tokens:
        root = state.root
        tokens, drafted = decode_step(state, drafter, depth)
        steps.append([root, *tokens[:drafted]])
        emitted += drafted + 1
        if eos_token_id is not None and eos_token_id in steps[-1]:
            break
    seconds = time.perf_counter() - t0
    return {"steps": steps, "new_tokens": [t for s in steps for t in s], "seconds": seconds}


def compare_steps(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """-> {"compared": steps both have, "identical": every step equal and as many steps, "first_mismatch": None or
    {"step", "ours", "theirs"} (the tokens each appended there: root, then accepted drafts)}."""
    n = min(len(ours), len(theirs))
    for i in range(n):
        if list(ours[i]) != list(theirs[i]):
            return {"compared": i + 1, "identical": False,
                    "first_mismatch": {"step": i, "ours": list(ours[i]), "theirs": list(theirs[i])}}
    if len(ours) != len(theirs):
        return {"compared": n, "identical": False,
                "first_mismatch": {"step": n, "ours": ours[n] if n < len(ours) else None,
                                   "theirs": theirs[n] if n < len(theirs) else None}}
    return {"compared": n, "identical": True, "first_mismatch": None}


def accepted_counts(steps: list[list[int]]) -> list[int]:
    """Accepted drafts per step (each step appends its root and then them)."""
    return [len(s) - 1 for s in steps]
