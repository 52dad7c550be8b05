"""A static decode step: the base decoder's forward at fixed shapes, so that on CUDA it runs as a replayed CUDA graph.

    state = prefill(model, ids, sampling, generator, drafter)
    attach_static(state, drafter, max_new_tokens)     # -> the StaticDecoder now in state.decoder, or None (eager)

On a GPU a 7B step at batch 1 is host time: about 1,500 kernel launches a forward take longer than the kernels.
A CUDA graph launches them all at once, but replays fixed shapes at fixed addresses, and a decode step changes both:
the cache grows, the tree changes size. So here
  - the KV cache has a fixed capacity (StaticCache: prompt + new tokens + the largest verify size), its layers
    write new rows at the positions held in a device tensor and hand attention the whole capacity;
  - a step of N tokens runs at the smallest verify size in BUCKETS >= N, its input ids, position ids, cache
    positions and additive mask [1, 1, size, capacity] copied into buffers preallocated once (padding rows write
    slots past the step's own, which the mask hides and the next step overwrites);
  - on CUDA each size is captured as a graph the first time it is used and replayed after; elsewhere, or where
    capture fails, the same fixed-shape forward runs eagerly (`mode` and `fallback` say which and why).
A model keeps its StaticDecoder from one generate() to the next (capacity rounded up to CAPACITY_STEP positions), so
graphs are captured once per model and verify size, not at every call; one static decode at a time per model.
The engine's step is unchanged: StaticDecoder is called as the decoder is (decode_step, verify_tree) and
StaticCache prunes and rewinds as the engine's cache does (kv_cache.keep_accepted, DecodeState.rewind).
Not for drafters that read intermediate layers (EAGLE-3's taps: hooks do not run in a replayed graph) nor
sliding-window models (their per-layer masks): attach_static leaves those eager.
"""
from __future__ import annotations

import weakref
from types import SimpleNamespace

import torch

from models.engine.kv_cache import StaticCache

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)     # verify sizes a step is rounded up to (one graph each)
CAPACITY_STEP = 1024                         # cache positions are allocated in these steps (a 7B Llama: 512 MB)
_KEPT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()     # decoder module -> its StaticDecoder


class StaticDecoder:
    """The decoder called at fixed shapes (module docstring). `mode`: "cuda_graphs" or "static_eager";
    `fallback`: why a size runs eagerly where graphs were asked for, by size."""

    def __init__(self, decoder, cache: StaticCache, positions: torch.Tensor, capture: bool,
                 buckets: tuple[int, ...] = BUCKETS):
        self._decoder = weakref.ref(decoder)        # _KEPT's key: a strong reference would keep the model alive
        self.cache, self.positions, self.buckets = cache, positions, tuple(buckets)
        self.config, self.layers = decoder.config, decoder.layers       # what verify_masks and LayerTaps read
        device, dtype = positions.device, next(decoder.parameters()).dtype
        top = self.buckets[-1]
        self.ids = torch.zeros(1, top, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(1, top, dtype=torch.long, device=device)
        self.mask = torch.full((1, 1, top, cache.capacity), torch.finfo(dtype).min, dtype=dtype, device=device)
        self.mode = "cuda_graphs" if capture else "static_eager"
        self.graphs: dict[int, tuple] = {}
        self.fallback: dict[int, str] = {}
        self.pool = None

    @property
    def decoder(self):
        return self._decoder()

    def bucket(self, n: int) -> int:
        """The smallest verify size >= n (n itself beyond the largest: run eagerly at that size)."""
        return next((b for b in self.buckets if b >= n), n)

    def fill(self, input_ids: torch.Tensor, attention_mask, position_ids: torch.Tensor, past: int) -> int:
        """Copy one step's inputs into the buffers at its verify size; -> that size. No mask: the plain step's
        (every filled slot and itself). Padding rows: token 0 at the next slots, each seeing its own slot only."""
        n = input_ids.shape[1]
        b = self.bucket(n)
        if b > self.ids.shape[1] or past + b > self.cache.capacity:
            raise ValueError(f"a step of {n} tokens after {past} does not fit the static buffers "
                             f"({self.ids.shape[1]} tokens, {self.cache.capacity} positions)")
        self.ids[0, :n], self.ids[0, n:b] = input_ids[0], 0
        self.position_ids[0, :n] = position_ids[0]
        self.position_ids[0, n:b] = past + torch.arange(n, b, device=self.ids.device)
        self.positions[:b] = past + torch.arange(b, device=self.ids.device)
        self.mask[0, 0, :b].fill_(torch.finfo(self.mask.dtype).min)
        if attention_mask is None:
            self.mask[0, 0, :n, :past + n] = 0
        else:
            self.mask[0, 0, :n, :past + n] = attention_mask[0, 0]
        rows = torch.arange(n, b, device=self.ids.device)
        self.mask[0, 0, rows, past + rows] = 0
        return b

    def _forward(self, b: int):
        return self.decoder(input_ids=self.ids[:, :b], attention_mask=self.mask[:, :, :b],
                            position_ids=self.position_ids[:, :b], past_key_values=self.cache,
                            use_cache=True).last_hidden_state

    def _capture(self, b: int):
        """The size-b forward captured as a CUDA graph (warmed up on a side stream first) -> (graph, output)."""
        if self.ids.device.type != "cuda":     # a graph captured around CPU work would replay nothing
            raise RuntimeError(f"CUDA graphs capture CUDA work; this decoder runs on {self.ids.device.type}")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(b)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(b)
        self.pool = graph.pool()
        return graph, out

    def run(self, b: int) -> torch.Tensor:
        """The size-b forward on the filled buffers: a replayed graph where one was captured, else eager."""
        if self.mode != "cuda_graphs" or b in self.fallback or b not in self.buckets:
            return self._forward(b)
        if b not in self.graphs:
            try:
                self.graphs[b] = self._capture(b)
            except Exception as e:  # noqa: BLE001  (capture is an optimisation; the eager forward is the reference)
                self.fallback[b] = f"{type(e).__name__}: {str(e)[:200]}"
                return self._forward(b)
        graph, out = self.graphs[b]
        graph.replay()
        return out

    def __call__(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=True):
        if past_key_values is not self.cache:
            raise ValueError("a StaticDecoder runs on its own StaticCache (attach_static puts it in the state)")
        if isinstance(attention_mask, dict):
            raise ValueError("per-layer-type masks (sliding windows) are not supported by the static step")
        n, past = input_ids.shape[1], self.cache.get_seq_length()
        hidden = self.run(self.fill(input_ids, attention_mask, position_ids, past))
        self.cache.set_length(past + n)
        return SimpleNamespace(last_hidden_state=hidden[:, :n].clone())


def static_unsupported(decoder, drafter) -> str | None:
    """Why the static step does not apply to this decoder and drafter, or None."""
    if tuple(getattr(drafter, "taps", ()) or ()):
        return "the drafter reads intermediate layers (hooks do not run in a replayed graph)"
    if getattr(decoder.config, "sliding_window", None):
        return "a sliding-window model (per-layer masks)"
    return None


def attach_static(state, drafter, max_new_tokens: int, capture: bool | None = None,
                  buckets: tuple[int, ...] = BUCKETS) -> StaticDecoder | None:
    """Put a StaticDecoder and its StaticCache (loaded with the prefill's rows) into a DecodeState after prefill;
    capture: CUDA graphs (default: on a CUDA device). -> the StaticDecoder, or None where it does not apply (the
    state stays eager)."""
    if static_unsupported(state.decoder, drafter):
        return None
    capture = state.device.type == "cuda" if capture is None else capture
    need = state.past + max_new_tokens + max(buckets) + 1
    static = _KEPT.get(state.decoder)
    if (static is None or static.cache.capacity < need or static.buckets != tuple(buckets)
            or static.mode != ("cuda_graphs" if capture else "static_eager")):
        capacity = -(-need // CAPACITY_STEP) * CAPACITY_STEP
        positions = torch.zeros(max(buckets), dtype=torch.long, device=state.device)
        static = StaticDecoder(state.decoder, StaticCache(len(state.cache.layers), capacity, positions), positions,
                               capture, buckets)
        _KEPT[state.decoder] = static
    static.cache.load(state.cache)
    state.decoder, state.cache = static, static.cache
    return static


def static_summaries() -> list[dict]:
    """What each model's kept StaticDecoder did: its mode, the verify sizes captured as graphs, and the sizes that fell
    back to the eager forward with the reason (for a benchmark's record)."""
    return [{"mode": d.mode, "capacity": d.cache.capacity, "graphs": sorted(d.graphs), "fallback": dict(d.fallback)}
            for d in list(_KEPT.values())]
