"""Step-by-step conformance of our decoder with the authors' Medusa code (docs/conformance.md): heads built from
a seed, our steps recorded as the official loop records its own, and the two compared step by step.

    heads = seeded_medusa_heads(model, seed=0)                       # 4 Medusa-1 heads, shared full-vocabulary LM head
    tree = medusa_v01_tree()                                          # medusa-llm 0.1's medusa_choices=[1, 7, 6]
    rec = record_steps(model, drafter, ids, max_new_tokens=64, eos_token_id=tok.eos_token_id)
    rec["steps"]          # per step [root, accepted drafts...]: the tokens it appends, as 0.1 and HEAD append them
    compare_steps(ours["steps"], official["steps"])   # {"compared", "identical", "first_mismatch"}
    eagle = seeded_eagle_module(model, seed=0)                       # an EAGLE-1 layer from a seed (the EAGLE check)
    tree = paths_tree("eagle_mc_sim_7b_63", paths)                   # a static tree given by its paths

The official loop (medusa_generate) appends, per step, the root (the base model's token from the step before)
and the drafts it accepted, and stops after the step whose tokens reach the limit or contain EOS; record_steps
runs our decode step (models/engine/decoding.py) under that same stop rule, the tree never cut near the limit.
"""
from __future__ import annotations

import itertools
import time

import torch

from models.engine.decoding import SamplingConfig, decode_step, prefill
from models.engine.trees import TreeSpec
from models.shared import DraftHeads, HeadsConfig, build_heads
from models.methods.eagle.eagle import EagleModule
import models.methods.drafting  # noqa: F401  (every method, and its proposer)


def medusa_v01_tree(topk: tuple[int, ...] = (7, 6)) -> TreeSpec:
    """The tree medusa-llm 0.1 builds from medusa_choices=[1, *topk]: every combination of head d's top topk[d]
    (its cartesian product; [1, 7, 6]: 7 nodes at depth 1, 42 at depth 2)."""
    paths = [p for d in range(1, len(topk) + 1) for p in itertools.product(*[range(k) for k in topk[:d]])]
    return TreeSpec(f"medusa_v01_{'_'.join(map(str, (1, *topk)))}", tuple(paths), topk=max(10, *topk))


def seeded_medusa_heads(model, seed: int = 0, num_heads: int = 4, scale: float = 0.02) -> DraftHeads:
    """Medusa-1 heads (one ResBlock each, the base LM head shared, full vocabulary) whose ResBlock weights and
    biases are float32 draws N(0, scale^2) from torch.Generator(seed), head by head: the same heads on any
    machine, without trained weights. The blocks stay close to the identity, so head k proposes tokens likely
    after the root: enough accepted drafts for a comparison to mean something."""
    config = HeadsConfig.for_base(model, "medusa", num_heads, 1, share_lm_head=True)
    heads = build_heads(config, model)
    g = torch.Generator().manual_seed(int(seed))
    h = config.hidden_size
    with torch.no_grad():
        for k in range(num_heads):
            linear = heads.blocks[k][0].linear
            linear.weight.copy_(torch.randn(h, h, generator=g, dtype=torch.float32) * scale)
            linear.bias.copy_(torch.randn(h, generator=g, dtype=torch.float32) * scale)
    return heads.eval()


def paths_tree(name: str, paths, topk: int = 10) -> TreeSpec:
    """A static tree from its paths of ranks (as the authors' tree_choices lists hold them)."""
    return TreeSpec(name, tuple(tuple(int(r) for r in p) for p in paths), topk=topk)


def seeded_eagle_module(model, seed: int = 0, scale: float = 0.02) -> EagleModule:
    """An EAGLE-1 layer with the same weights on any machine, without training: EagleModule.from_base(model,
    seed) (its decoder layer's Linears N(0, 0.02^2) from that seed), then fc = [N(0, scale^2) | I + N(0, scale^2)]
    with bias N(0, scale^2) from torch.Generator(seed), float32. fc passes the feature f_t on, nearly unchanged,
    and the small random layer adds to it what the token and the context make of it: the predicted feature
    stays near f_t, so the drafts are likely tokens (the root's own runners-up, repeated tokens) and some steps
    accept drafts."""
    module = EagleModule.from_base(model, seed=seed)
    h = model.config.hidden_size
    g = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        weight = torch.randn(h, 2 * h, generator=g, dtype=torch.float32) * scale
        weight[:, h:] += torch.eye(h)
        module.fc.weight.copy_(weight)
        module.fc.bias.copy_(torch.randn(h, generator=g, dtype=torch.float32) * scale)
    return module.eval()


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
