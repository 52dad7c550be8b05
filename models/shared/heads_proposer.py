"""What the per-depth draft heads' proposers share (Medusa's: models/methods/medusa/proposer.py; Hydra's and Hydra++'s:
models/methods/hydra/proposer.py; models/engine/drafters/proposer.py: the protocol, select_children and the tree
walk): h_t, the state every head reads, kept through advances and rewinds, and each head's fast projection.

    proposer = heads.method.proposer(heads)          # a HeadsProposer subclass, from the heads' method
    proposer.start(ctx); logits = proposer.scores(frontier)                # [P or 1, Vd]

With a prefix layer (the family's prefix_layer: Hydra++), h_t is taken from that decoder layer run causally over
the base hidden states. Its own KV cache only ever receives accepted positions (`advance`), so it holds exactly the
accepted sequence and needs no rollback.
Heads with a draft vocabulary (DraftHeads.draft_ids, [Vd]) score those tokens only; a sampled node's q is
mapped back to the full vocabulary by the engine (zeros outside the draft vocabulary).
"""
from __future__ import annotations

import abc

import torch

from models.engine.drafters.base import AdvanceHistory, DraftContext
from models.engine.drafters.proposer import Frontier
from models.engine.kv_cache import new_cache
from models.engine.projection import project
from models.shared.draft_heads import DraftHeads


class HeadsProposer(abc.ABC):
    """heads: a DraftHeads, or any object with its config, family, head_logits (and read_hidden when its family has a
    prefix_layer: Hydra++). A subclass scores a frontier (scores; begin and end around a tree when it needs them).
    Its drafts read h_t from one buffer that advance and rewind overwrite in place, and nothing else that changes
    between steps, so a fixed tree's draft can be replayed as a CUDA graph (capturable;
    models/engine/drafters/graphed.py)."""
    taps = ()
    capturable = True

    def __init__(self, heads):
        self.heads, config = heads, heads.config
        self.prefixed = heads.family.prefix_layer
        self.max_depth = config.num_heads               # head d drafts depth d + 1: no deeper tree
        # The Linear each head ends in ([h] -> [Vd]; the frozen base LM head or its draft-vocabulary rows when
        # shared), so that head k runs as head_hidden + project (fast for few rows); other head objects:
        # head_logits over the full vocabulary.
        self.linears = None
        self.draft_ids = heads.draft_ids if isinstance(heads, DraftHeads) else None   # [Vd]; None: full vocabulary
        self.vocab_size = config.vocab_size
        if isinstance(heads, DraftHeads) and (heads.lm_heads is not None or heads.is_attached):
            self.linears = [heads.output_layer(k) for k in range(config.num_heads)]
        self.prefix_cache = new_cache() if self.prefixed else None
        self.h = None                                   # [h] hidden state the heads read (position t)
        self.history = AdvanceHistory()                 # (positions seen, h then) of the last advances (rewind)
        params = next(iter(heads.parameters()), None) if isinstance(heads, torch.nn.Module) else None
        self.dtype = None if params is None else params.dtype   # the heads' dtype (the base may run in bf16)

    @property
    def device(self) -> torch.device:
        return self.h.device

    # -- state ---------------------------------------------------------------------------------
    def start(self, ctx: DraftContext) -> None:
        """ctx.hidden: [T, h] base hidden states of the whole prompt (the heads read hidden states only)."""
        self.prefix_cache = new_cache() if self.prefixed else None
        self.history.clear()
        self.advance(ctx.hidden, [], 0)

    def advance(self, hidden: torch.Tensor, tokens: list[int], position: int) -> None:
        """hidden: [m, h] base hidden states of newly accepted positions position..position+m-1 (tokens: unused)."""
        if self.prefix_cache is None:
            h = hidden[-1]
        else:
            pos = torch.arange(position, position + hidden.shape[0], device=hidden.device).unsqueeze(0)
            h = self.heads.read_hidden(hidden.unsqueeze(0), pos, cache=self.prefix_cache)[0, -1]
        h = h if self.dtype is None else h.to(self.dtype)
        self.history.push(position + hidden.shape[0], h)
        self.set_h(h)

    def set_h(self, h: torch.Tensor) -> None:
        """h_t into self.h: copied into the same storage as before where it fits (a captured draft reads that)."""
        same = self.h is not None and (self.h.shape, self.h.dtype, self.h.device) == (h.shape, h.dtype, h.device)
        if same and (torch.is_inference_mode_enabled() or not torch.is_inference(self.h)):
            self.h.copy_(h)
        else:
            self.h = h.clone()

    def static_inputs(self) -> tuple[torch.Tensor, ...]:
        """What a draft reads that changes between steps (a captured draft checks their storage is unmoved)."""
        return (self.h,)

    def rewind(self, position: int) -> None:
        """Back to the state after the first `position` positions: one of the last advances' ends."""
        self.set_h(self.history.back_to(position))
        if self.prefix_cache is not None:
            self.prefix_cache.crop(position - self.prefix_cache.get_seq_length())

    # -- proposals -----------------------------------------------------------------------------
    def head_logits(self, k: int, hidden: torch.Tensor, path: torch.Tensor | None = None) -> torch.Tensor:
        """Head k's logits over the draft vocabulary: hidden [R, h], path [R, k+1] -> [R, Vd], with the fast projection."""
        if self.linears is None:
            return self.heads.head_logits(k, hidden, path)
        return project(self.linears[k], self.heads.head_hidden(k, hidden, path))

    def begin(self, root: int, depth: int) -> None:
        pass

    @abc.abstractmethod
    def scores(self, frontier: Frontier) -> torch.Tensor:
        """[R or 1, Vd] logits of the frontier nodes' children over the draft vocabulary (one row shared by all: Medusa)."""

    def end(self) -> None:
        pass
