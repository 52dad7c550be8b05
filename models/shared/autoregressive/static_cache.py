"""A draft module's KV cache at fixed shapes, so that a fixed tree's draft can be replayed as a CUDA graph
(models/engine/drafters/graphed.py; used by the autoregressive proposer when DraftContext.static asks for it).

    cache = StaticDraftCache(num_layers, capacity, device, dtype)
    mask = cache.rows(n)                      # eager: the next n rows' slots, and their causal mask [1, 1, n, K]
    module(feats, tokens, positions, cache=cache.cache, attention_mask=mask); cache.commit(n)
    cache.set_base()                          # before a draft, outside the graph: base = the accepted rows
    mask = cache.tree_rows(offset, anc)       # in the graph: rows base + offset .., masked by their ancestors

The autoregressive proposer's dynamic cache grows by the accepted rows every step, and its tree rows' mask has
as many columns as the cache has rows, so no two drafts run at the same shapes. Here the cache has a fixed
capacity K (models/engine/kv_cache.StaticCache: new rows go to the slots in `positions`, attention reads all
K slots), and everything that changes from step to step is read from device tensors: the number of accepted rows
(`base`, filled before each draft), the slots a depth writes and the mask's accepted columns (both computed from
`base` inside the draft). Masked columns get the dtype's minimum, so attending over K slots gives what attending
over the filled ones gives. The capacity grows (a new cache, new addresses: a captured draft is then captured
anew, through static_inputs) when the accepted rows and a tree would not fit.
"""
from __future__ import annotations

import torch

from models.engine.kv_cache import StaticCache

CAPACITY_STEP = 1024              # slots are allocated in these steps
ROOM = 1024                       # rows kept free beyond the accepted ones when a cache is made (a tree's, a path's)


class StaticDraftCache:
    def __init__(self, num_layers: int, capacity: int, device: torch.device, dtype: torch.dtype):
        self.num_layers, self.device, self.dtype = num_layers, device, dtype
        self.capacity = -(-capacity // CAPACITY_STEP) * CAPACITY_STEP
        self.positions = torch.zeros(self.capacity, dtype=torch.long, device=device)   # the slots a forward writes
        self.cache = StaticCache(num_layers, self.capacity, self.positions)
        self.slots = torch.arange(self.capacity, device=device)
        self.base = torch.zeros(1, dtype=torch.long, device=device)                     # accepted rows, for a draft
        self.length = 0

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor a captured draft reads from this cache (their storage must not move between replays)."""
        return (self.positions, self.base, *(t for layer in self.cache.layers for t in layer.storage()))

    @staticmethod
    def for_prompt(kept: "StaticDraftCache | None", num_layers: int, prompt_rows: int, device, dtype):
        """An empty cache with room for the prompt's rows and ROOM more: `kept` (emptied) where it is that big and
        alike, so that a captured draft's addresses hold from one decode to the next."""
        if (kept is not None and kept.capacity >= prompt_rows + ROOM and kept.num_layers == num_layers
                and kept.device == device and kept.dtype == dtype):
            kept.crop(0)
            return kept
        return StaticDraftCache(num_layers, prompt_rows + ROOM, device, dtype)

    def with_room(self, rows: int) -> "StaticDraftCache":
        """This cache where `rows` more fit; else a bigger one (ROOM more) holding the same accepted rows."""
        if self.length + rows <= self.capacity:
            return self
        bigger = StaticDraftCache(self.num_layers, self.length + rows + ROOM, self.device, self.dtype)
        if self.length:
            bigger.cache.load(self.cache)
            bigger.crop(self.length)
        return bigger

    def rows(self, n: int) -> torch.Tensor:
        """For the next n rows written eagerly (the prompt's, an accepted path's): their slots into `positions`,
        and their additive mask [1, 1, n, K] (row i sees every filled slot and the new rows up to itself)."""
        past = self.length
        if past + n > self.capacity:
            raise ValueError(f"the static draft cache holds {self.capacity} rows; {past + n} asked for")
        self.positions[:n] = past + self.slots[:n]
        visible = self.slots[None, :] <= (past + self.slots[:n])[:, None]                     # [n, K]
        return self._additive(visible)

    def commit(self, n: int) -> None:
        """The n rows just written are kept."""
        self.crop(self.length + n)

    def crop(self, length: int) -> None:
        self.length = length
        for layer in self.cache.layers:
            if layer.storage():                      # written at least once
                layer.set_length(length)

    def set_base(self) -> None:
        """Before a draft (outside a captured graph): the accepted rows it starts from."""
        self.base.fill_(self.length)

    def tree_rows(self, offset: int, seen: torch.Tensor) -> torch.Tensor:
        """For a depth's R tree rows written after `offset` earlier tree rows of the same draft (graph-safe: reads
        `base`, not the host's length): their slots base + offset .. into `positions`, and their mask [1, 1, R, K]:
        every accepted slot, and of the C = offset + R tree rows those `seen` [R, C] marks (ancestors and self)."""
        R, C = seen.shape
        torch.add(self.slots[offset:offset + R], self.base, out=self.positions[:R])
        visible = (self.slots < self.base).expand(R, -1).clone()                                # [R, K]
        visible.index_copy_(1, self.slots[:C] + self.base, seen)
        return self._additive(visible)

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(1, 1, *visible.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
