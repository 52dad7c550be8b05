"""Medusa heads and the authors' Medusa tree without training, for the step-by-step check against the authors' code
(docs/conformance.md; pipelines/conformance.py).

    heads = seeded_medusa_heads(model, seed=0)       # 4 Medusa-1 heads, shared full-vocabulary LM head
    tree = medusa_v01_tree()                         # medusa-llm 0.1's medusa_choices=[1, 7, 6]
"""
from __future__ import annotations

import itertools

import torch

from models.engine.trees import TreeSpec
from models.methods.medusa import MEDUSA
from models.shared.draft_heads import DraftHeads, HeadsConfig, build_heads


def medusa_v01_tree(top_k: tuple[int, ...] = (7, 6)) -> TreeSpec:
    """The tree medusa-llm 0.1 builds from medusa_choices=[1, *top_k]: every combination of head d's top top_k[d]
    (its cartesian product; [1, 7, 6]: 7 nodes at depth 1, 42 at depth 2)."""
    paths = [p for d in range(1, len(top_k) + 1) for p in itertools.product(*[range(k) for k in top_k[:d]])]
    return TreeSpec(f"medusa_v01_{'_'.join(map(str, (1, *top_k)))}", tuple(paths), top_k=max(10, *top_k))


def seeded_medusa_heads(model, seed: int = 0, num_heads: int = 4, scale: float = 0.02) -> DraftHeads:
    """Medusa-1 heads (one ResBlock each, the base LM head shared, full vocabulary) whose ResBlock weights and
    biases are float32 draws N(0, scale^2) from torch.Generator(seed), head by head: the same heads on any
    machine, without trained weights. The blocks stay close to the identity, so head k proposes tokens likely
    after the root: enough accepted drafts for a comparison to mean something."""
    config = HeadsConfig.for_base(model, MEDUSA.name, num_heads, 1, share_lm_head=True)
    heads = build_heads(config, MEDUSA, model)
    g = torch.Generator().manual_seed(int(seed))
    h = config.hidden_size
    with torch.no_grad():
        for k in range(num_heads):
            linear = heads.blocks[k][0].linear
            linear.weight.copy_(torch.randn(h, h, generator=g, dtype=torch.float32) * scale)
            linear.bias.copy_(torch.randn(h, generator=g, dtype=torch.float32) * scale)
    return heads.eval()
