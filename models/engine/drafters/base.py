"""The drafter protocol and what a draft carries (make_drafter, which builds drafters from a spec, and the kinds it
knows: models/engine/drafting.py).

    drafter = make_drafter({"kind": "heads", "tree": spec}, heads=heads)       # models/engine/drafters/tree.py
    drafter = make_drafter({"kind": "prompt_lookup", "num_tokens": 8})        # .../prompt_lookup.py
    res = generate(model, tok, ids, drafter=drafter)                          # None: the autoregressive baseline

A drafter (StepDrafter) is driven by the decode step (models/engine/decoding.py) through four calls:
    start(ctx)                          after the prefill: DraftContext (prompt ids, hidden states, sampling, generator)
    draft(root, max_depth) -> Draft     the tree below `root`, no deeper than max_depth (N = 1: a plain step); or a
                                        DeviceTree, kept on the device (greedy decoding under static drafts)
    advance(hidden, tokens, position)   the accepted path's base hidden states [m, h] and tokens (root first),
                                        now at positions position .. position + m - 1
    rewind(position)                    forget every position from `position` on (timing, tests)
The hidden states are the base's final ones [.., h], or, when the drafter has a non-empty `taps` attribute
(EAGLE-3), the base states it names, side by side [.., len(taps) * h] (models/engine/taps.py), taken during the
same forwards. Everything a caller may want from a step comes back in the Draft; nothing is set on a drafter from
outside.
A new drafter is one module: a class with those four methods and a builder(spec, **parts), listed in DRAFTERS in
models/engine/drafting.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from models.engine.acceptance import SamplingConfig
from models.engine.trees import TreeBuffers, additive

# draft_q(node) -> q [V] of the node's children, (q, drawn) when only its first `drawn` children were drawn from q
# (the later ones are point masses: a prompt-lookup branch), or None (every child a point mass)
DraftQ = Callable[[int], torch.Tensor | tuple[torch.Tensor, int] | None] | None


@dataclass
class Draft:
    """One step's proposal. node_probs: the drafter's probability that each node is accepted (the product of
    its proposal probabilities along the path, root 1), when the drafter was built to report it; extras:
    what else a drafter reports (prompt lookup: {"ngram": length of the matched n-gram})."""
    buf: TreeBuffers
    tokens: torch.Tensor                          # [N], node 0 = the root
    draft_q: DraftQ = None                        # sampled drafts: node -> q [V] of its children
    node_probs: torch.Tensor | None = None        # [N] float, root 1
    extras: dict = field(default_factory=dict)

    @property
    def num_drafts(self) -> int:
        return self.buf.num_tokens - 1


@dataclass
class DeviceTree:
    """One step's proposal that never left the device (a grown tree at fixed shapes: drafters/graphed_growth.py, or a
    fixed tree's replayed draft), verified as TreeBuffers are (it answers what the verify step reads of a tree:
    num_tokens, depth, additive_mask) and accepted greedily there (acceptance.accept_on_device). K nodes, node 0 the
    root, every parent before its children."""
    tokens: torch.Tensor                          # [K] long
    ancestors: torch.Tensor                       # [K, K] bool: node i's ancestors and itself
    depth: torch.Tensor                           # [K] long, root 0
    parent: torch.Tensor                          # [K] long, the parent's node index (the root: 0)

    @property
    def num_drafts(self) -> int:
        return self.tokens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    def additive_mask(self, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """[1, 1, K, K] float, as TreeBuffers.additive_mask: 0 where a node sees an ancestor or itself."""
        return additive(self.ancestors, dtype)[None, None].to(device)


@dataclass
class DraftContext:
    """What a drafter may read when decoding starts."""
    input_ids: torch.Tensor                       # [T] the prompt
    hidden: torch.Tensor                          # [T, h] its base hidden states
    sampling: SamplingConfig
    generator: torch.Generator | None = None
    static: bool = False                          # fixed-shape drafts asked for (with host.static_step): a drafter
                                                  # whose draft has fixed shapes may replay it as a CUDA graph
    on_device: bool = True                        # with static, greedy: drafts may be DeviceTrees; False where the
                                                  # caller reads a draft's buffers (a lookup branch merged in)


class StepDrafter(Protocol):
    def start(self, ctx: DraftContext) -> None: ...
    def draft(self, root: int, max_depth: int) -> Draft: ...
    def advance(self, hidden: torch.Tensor, tokens: list[int], position: int) -> None: ...
    def rewind(self, position: int) -> None: ...


class AdvanceHistory:
    """A drafter's state at the end of each of its last `size` advances (positions seen, state), so that
    rewind(position) can go back to one of them."""

    def __init__(self, size: int = 16):
        self.size, self.entries = size, []

    def clear(self) -> None:
        self.entries = []

    def push(self, positions: int, state) -> None:
        self.entries = [*self.entries[-(self.size - 1):], (positions, state)]

    def back_to(self, position: int, who: str = "the drafter"):
        """The state after the first `position` positions; later entries are dropped."""
        while self.entries and self.entries[-1][0] > position:
            self.entries.pop()
        if not self.entries or self.entries[-1][0] != position:
            raise ValueError(f"{who} can rewind to the end of one of its last {self.size} advances, "
                             f"not to position {position}")
        return self.entries[-1][1]
