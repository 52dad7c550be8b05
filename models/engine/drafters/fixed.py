"""A fixed chain of drafts below every root: for timing the step at a given size (models/measure/latency.py)
and for tests. It keeps no state, so rewinding is free.

    drafter = make_drafter({"kind": "fixed", "drafts": [5, 7, 9]})
"""
from __future__ import annotations

import torch

from models.engine.drafters.base import Draft, DraftContext
from models.engine.trees import TreeBuffers, chain_tree


class FixedDrafter:
    def __init__(self, drafts):
        self.drafts = torch.as_tensor(drafts, dtype=torch.long).flatten()
        self.buf = TreeBuffers.build(chain_tree(self.drafts.numel(), name=f"fixed{self.drafts.numel()}"))

    def start(self, ctx: DraftContext) -> None:
        self.drafts = self.drafts.to(ctx.input_ids.device)

    def draft(self, root: int, max_depth: int) -> Draft:
        buf = self.buf.to_depth(max_depth)
        return Draft(buf, torch.cat([self.drafts.new_tensor([root]), self.drafts])[:buf.num_tokens])

    def advance(self, hidden: torch.Tensor, tokens: list[int], position: int) -> None:
        pass

    def rewind(self, position: int) -> None:
        pass


def build(spec: dict, **_) -> FixedDrafter:
    return FixedDrafter(spec["drafts"])
