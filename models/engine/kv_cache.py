"""The base model's KV cache during decoding, pruned to the accepted path after every verify step.

    cache = new_cache()                                  # a transformers DynamicCache subclass
    keep_accepted(cache, base, pasts, paths)              # after a verify step: each row's accepted path stays

After verifying a tree, the cache holds past + N entries: the committed prefix and every tree
node. Only the accepted nodes (root first, ancestors before descendants, so their indices rise)
may stay; their rows are moved down to past..past+m-1 and the rest is cut off.

transformers' DynamicLayer concatenates on every update, copying the whole cache once per layer
and step (about 15% of a 1-token step of SmolLM2 at 600 cached tokens on a CPU). GrowingLayer
keeps keys/values [B, kv_heads, capacity, head_dim] with spare room, writes new rows in place and
hands the attention a view of the filled part; capacity doubles when full. It is still a cache
the model's normal forward drives through its public update() API. StaticLayer and StaticCache are its fixed-capacity
form, which the static step (models/engine/static_step.py) and a drafter's static cache replay at fixed addresses;
their attention reads the first `span` slots (the static step sets it per step; by default the whole capacity).
"""
from __future__ import annotations

import functools
import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

MIN_CAPACITY = 256


@functools.lru_cache(maxsize=None)
def _cache_name(forward) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def cache_kwargs(module, cache) -> dict:
    """{name: cache} under the name `module`'s forward takes it: `cache` from transformers 5.24 on (where
    `past_key_values` is deprecated, a warning a call), `past_key_values` before (the GPU box's 5.17)."""
    cls = type(module)
    return {_cache_name(getattr(cls, "forward", None) or cls.__call__): cache}    # a stand-in of ours: its __call__


def given_cache(kwargs: dict):
    """The cache a forward of ours was handed, under either name (a stand-in for a transformers module)."""
    return kwargs.get("cache", kwargs.get("past_key_values"))


class GrowingLayer(DynamicLayer):
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.length, self._k, self._v = 0, None, None

    def _reserve(self, need: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        cap = 0 if self._k is None else self._k.shape[-2]
        if need <= cap:
            return
        cap = max(need, 2 * cap, MIN_CAPACITY)
        B, H, _, Dk = like_k.shape
        k = like_k.new_empty(B, H, cap, Dk)
        v = like_v.new_empty(B, H, cap, like_v.shape[-1])
        if self.length:
            k[:, :, :self.length] = self._k[:, :, :self.length]
            v[:, :, :self.length] = self._v[:, :, :self.length]
        self._k, self._v = k, v

    def _set_length(self, n: int) -> None:
        self.length = n
        self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]   # views of the filled part

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, n = self.length, key_states.shape[-2]
        self._reserve(start + n, key_states, value_states)
        self._k[:, :, start:start + n] = key_states
        self._v[:, :, start:start + n] = value_states
        self._set_length(start + n)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove and self.is_initialized:
            self._set_length(max(self.length + tokens_to_remove, 0))

    def keep_rows_of_each(self, moves: list[tuple[int, int, torch.Tensor]], length: int) -> None:
        """For each (b, past, src): batch row b's rows src (rising) to past..past+len(src)-1; then every row cut to
        `length` (keep_accepted)."""
        for b, past, src in moves:
            self._k[b, :, past:past + src.numel()] = self._k[b, :, src]      # the gather copies first: overlap is safe
            self._v[b, :, past:past + src.numel()] = self._v[b, :, src]
        self._set_length(length)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows `indices` (transformers' Cache API; batched generation drops finished rows)."""
        if self.is_initialized and self._k is not None:
            self._k, self._v = self._k[indices], self._v[indices]
            self._set_length(self.length)

    def reset(self) -> None:
        super().reset()
        self.length, self._k, self._v = 0, None, None


class GrowingCache(DynamicCache):
    """A DynamicCache whose layers are GrowingLayers (created lazily, one per decoder layer)."""

    def __init__(self):
        Cache.__init__(self, layer_class_to_replicate=GrowingLayer)


def new_cache() -> DynamicCache:
    # Every layer full-attention: sliding-window layers keep their own truncated view and could not be
    # pruned row by row (a sliding-window model is decoded as if its window were unlimited).
    return GrowingCache()


def keep_accepted(cache: DynamicCache, base: int, pasts: list[int], paths: list[list[int]]) -> None:
    """After a verify step that wrote every row's tree at columns base.. (B = 1: base is the row's own past): row b
    keeps its columns base + paths[b] (node indices, rising: root first, ancestors before descendants) at
    pasts[b].., and the cache is cut to the longest row (a shorter row's columns past its own length are garbage
    its mask hides)."""
    device = cache.layers[0].keys.device
    moves = [(b, p, torch.tensor(path, device=device) + base) for b, (p, path) in enumerate(zip(pasts, paths))
             if not (p == base and path == list(range(len(path))))]         # already in place: a cut is enough
    length = max(p + len(path) for p, path in zip(pasts, paths))
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer):
            layer.keep_rows_of_each(moves, length)
        elif len(pasts) == 1:                             # transformers' own DynamicLayer, one sequence
            for name in ("keys", "values"):               # [1, kv_heads, base + N, head_dim]
                t = getattr(layer, name)
                for _, p, src in moves:
                    t[:, :, p:p + src.numel()] = t[:, :, src]
                setattr(layer, name, t[:, :, :length])
        else:
            raise TypeError(f"a batched step prunes GrowingLayer caches (kv_cache.new_cache), not {type(layer).__name__}")


class StaticLayer(GrowingLayer):
    """A GrowingLayer of fixed capacity: new rows go to the slots in `positions` (a device tensor the step fills),
    and attention gets the first `span` slots (the mask hides the unfilled ones) as views that start at the
    storage's own address, so for a given span no shape or address ever changes."""

    def __init__(self, capacity: int, positions: torch.Tensor):
        super().__init__()
        self.capacity, self.positions, self.span = capacity, positions, capacity

    def _reserve(self, need: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        if need > self.capacity:
            raise ValueError(f"the static cache holds {self.capacity} positions; {need} asked for")
        if self._k is None:
            B, H, _, D = like_k.shape
            self._k = like_k.new_zeros(B, H, self.capacity, D)
            self._v = like_v.new_zeros(B, H, self.capacity, like_v.shape[-1])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._reserve(self.length + key_states.shape[-2], key_states, value_states)
        pos = self.positions[:key_states.shape[-2]]
        self._k.index_copy_(2, pos, key_states)
        self._v.index_copy_(2, pos, value_states)
        return self._k[:, :, :self.span], self._v[:, :, :self.span]    # the length is set by the step, not here

    def load(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Start from these filled rows [B, kv_heads, n, head_dim] (another cache's), in the same storage as
        before when this layer was used already (captured graphs read those addresses)."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self._reserve(keys.shape[-2], keys, values)
        self._k[:, :, :keys.shape[-2]], self._v[:, :, :keys.shape[-2]] = keys, values
        self.set_length(keys.shape[-2])

    def set_length(self, n: int) -> None:
        self._set_length(n)

    def storage(self) -> tuple[torch.Tensor, ...]:
        """The key and value tensors of full capacity (a replayed graph reads them), or () before the first write."""
        k = getattr(self, "_k", None)                # set by the first write (GrowingLayer.lazy_initialization)
        return () if k is None else (k, self._v)


class StaticCache(Cache):
    """One StaticLayer per decoder layer, all writing at the same `positions`."""

    def __init__(self, num_layers: int, capacity: int, positions: torch.Tensor):
        super().__init__(layers=[StaticLayer(capacity, positions) for _ in range(num_layers)])
        self.capacity = self.span = capacity

    def set_span(self, span: int) -> None:
        """Attention reads slots 0..span-1 from the next forward on (a graph captured at a span keeps reading it)."""
        if not 0 < span <= self.capacity:
            raise ValueError(f"a span of {span} slots in a static cache of {self.capacity}")
        self.span = span
        for layer in self.layers:
            layer.span = span

    def load(self, cache: Cache) -> None:
        """Copy the filled rows of another cache (the prefill's) into this one."""
        for mine, theirs in zip(self.layers, cache.layers):
            mine.load(theirs.keys, theirs.values)

    def set_length(self, n: int) -> None:
        for layer in self.layers:
            layer.set_length(n)
