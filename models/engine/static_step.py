"""A static decode step: the base decoder's forward at fixed shapes, so that on CUDA it runs as a replayed CUDA graph.

    state = prefill(model, ids, sampling, generator, drafter)
    attach_static(state, drafter, max_new_tokens)     # -> the StaticDecoder now in state.decoder, or None (eager)

On a GPU a 7B step at batch 1 is host time: about 1,500 kernel launches a forward take longer than the kernels.
A CUDA graph launches them all at once, but replays fixed shapes at fixed addresses, and a decode step changes both:
the cache grows, the tree changes size. So here
  - the KV cache has a fixed capacity (StaticCache: prompt + new tokens + the largest verify size), its layers
    write new rows at the positions held in a device tensor;
  - a step of N tokens runs at the smallest verify size in BUCKETS >= N, its input ids, position ids, cache
    positions and additive mask copied into buffers preallocated once (padding rows write slots past the step's
    own, which the mask hides and the next step overwrites);
  - attention reads only the cache's first `span` slots and mask columns (span_of: the filled ones rounded up to
    SPAN_STEP; views at the storage's own address): its cost grows with the positions it reads (over the whole
    capacity, 1.45 ms of a 7B step on an H200), and a graph needs fixed shapes, hence spans in steps;
  - on CUDA each (verify size, span) is captured as a graph the first time it is used and replayed after;
    elsewhere, or where capture fails, the same fixed-shape forward runs eagerly (`mode` and `fallback` say which
    and why).
A model keeps its StaticDecoder from one generate() to the next (capacity rounded up to CAPACITY_STEP positions), so
graphs are captured once per model, verify size and span, not at every call; one static decode at a time per model.
The engine's step is unchanged: StaticDecoder is called as the decoder is (step.py's verify, at B = 1) and
StaticCache prunes and rewinds as the engine's cache does (kv_cache.keep_accepted, DecodeState.rewind).
Where graphs are captured, the layers' element-wise parts (norms, SiLU-and-multiply) are compiled and swapped in
for these forwards only (models/engine/fused.py).
A drafter's taps (EAGLE-3's intermediate layers, models/engine/taps.py) are written inside the forward: each tapped
layer's output is copied into `tap_buffer` by a device copy that a captured graph replays (step_taps reads it).
Not for sliding-window models (their per-layer masks): attach_static leaves those eager.
"""
from __future__ import annotations

import contextlib
import weakref
from types import SimpleNamespace

import torch

from models.engine.fused import FusedParts
from models.engine.kv_cache import StaticCache, cache_kwargs, given_cache
from models.engine.taps import WrittenTaps

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)     # verify sizes a step is rounded up to (one graph each)
CAPACITY_STEP = 1024                         # cache positions are allocated in these steps (a 7B Llama: 512 MB)
SPAN_STEP = 256                              # attention reads the cache in spans of these steps (a graph per span)
_KEPT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()     # decoder module -> its StaticDecoder


def span_of(past: int, b: int, capacity: int) -> int:
    """The cache slots a step of verify size b after `past` positions attends to: past + b rounded up to
    SPAN_STEP, at most the capacity."""
    return min(capacity, -(-(past + b) // SPAN_STEP) * SPAN_STEP)


class StaticDecoder:
    """The decoder called at fixed shapes (module docstring). `mode`: "cuda_graphs" or "static_eager"; `graphs`:
    the captured graphs by (verify size, span); `fallback`: why a (size, span) runs eagerly where graphs were asked
    for."""

    def __init__(self, decoder, cache: StaticCache, positions: torch.Tensor, capture: bool,
                 buckets: tuple[int, ...] = BUCKETS, taps: tuple[int, ...] = (), fuse: str | None = None):
        self._decoder = weakref.ref(decoder)        # _KEPT's key: a strong reference would keep the model alive
        self.cache, self.positions, self.buckets = cache, positions, tuple(buckets)
        self.config, self.layers = decoder.config, decoder.layers       # what step.row_masks and LayerTaps read
        device, dtype = positions.device, next(decoder.parameters()).dtype
        top = self.buckets[-1]
        self.ids = torch.zeros(1, top, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(1, top, dtype=torch.long, device=device)
        self.mask = torch.full((1, 1, top, cache.capacity), torch.finfo(dtype).min, dtype=dtype, device=device)
        self.mode = "cuda_graphs" if capture else "static_eager"
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.fallback: dict[tuple[int, int], str] = {}
        self.pool = None
        self.static_taps = tuple(int(i) for i in taps)     # layer outputs written into tap_buffer (EAGLE-3's taps)
        if not all(1 <= i <= len(self.layers) for i in self.static_taps):
            raise ValueError(f"taps {self.static_taps} are not layer outputs of a {len(self.layers)}-layer decoder")
        self.tap_buffer = torch.zeros(1, top, len(self.static_taps) * self.config.hidden_size, dtype=dtype,
                                      device=device)
        self.tapped_rows = 0                                # the last step's rows in tap_buffer (0: none since taps_for)
        self.fused = FusedParts(decoder, fuse) if fuse else None    # element-wise parts compiled (models/engine/fused.py)

    @property
    def decoder(self):
        return self._decoder()

    def bucket(self, n: int) -> int:
        """The smallest verify size >= n (n itself beyond the largest: run eagerly at that size)."""
        return next((b for b in self.buckets if b >= n), n)

    def fill(self, input_ids: torch.Tensor, attention_mask, position_ids: torch.Tensor,
             past: int) -> tuple[int, int]:
        """Copy one step's inputs into the buffers at its verify size; -> (that size, the span it attends to). No
        mask: the plain step's (every filled slot and itself). Padding rows: token 0 at the next slots, each
        seeing its own slot only."""
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
        return b, span_of(past, b, self.cache.capacity)

    def _forward(self, key: tuple[int, int]):
        b, span = key
        self.cache.set_span(span)                   # the layers hand attention views of the first span slots
        with self.fused.applied() if self.fused is not None else contextlib.nullcontext():
            return self.decoder(input_ids=self.ids[:, :b], attention_mask=self.mask[:, :, :b, :span],
                                position_ids=self.position_ids[:, :b], use_cache=True,
                                **cache_kwargs(self.decoder, self.cache)).last_hidden_state

    def _capture(self, key: tuple[int, int]):
        """The (size, span) forward captured as a CUDA graph (warmed up on a side stream first) -> (graph, output)."""
        if self.ids.device.type != "cuda":     # a graph captured around CPU work would replay nothing
            raise RuntimeError(f"CUDA graphs capture CUDA work; this decoder runs on {self.ids.device.type}")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(key)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(key)
        self.pool = graph.pool()
        return graph, out

    def run(self, key: tuple[int, int]) -> torch.Tensor:
        """The (verify size, span) forward on the filled buffers: a replayed graph where one was captured (the
        first use of a key captures it), else eager."""
        if self.mode != "cuda_graphs" or key in self.fallback or key[0] not in self.buckets:
            return self._forward(key)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(key)
            except Exception as e:  # noqa: BLE001  (capture is an optimisation; the eager forward is the reference)
                self.fallback[key] = f"{type(e).__name__}: {str(e)[:200]}"
                return self._forward(key)
        graph, out = self.graphs[key]
        graph.replay()
        return out

    def __call__(self, input_ids, attention_mask=None, position_ids=None, use_cache=True, **cache):
        if given_cache(cache) is not self.cache:
            raise ValueError("a StaticDecoder runs on its own StaticCache (attach_static puts it in the state)")
        if isinstance(attention_mask, dict):
            raise ValueError("per-layer-type masks (sliding windows) are not supported by the static step")
        n, past = input_ids.shape[1], self.cache.get_seq_length()
        with self._writing_taps():                  # eager and captured forwards copy their taps into tap_buffer
            hidden = self.run(self.fill(input_ids, attention_mask, position_ids, past))
        self.cache.set_length(past + n)
        self.tapped_rows = n
        return SimpleNamespace(last_hidden_state=hidden[:, :n].clone())

    @contextlib.contextmanager
    def _writing_taps(self):
        """Forward hooks on the tapped layers for the forwards run inside, whose only effect is a device copy of the
        layer's output into tap_buffer. Hooks, not output_hidden_states: the last tap (L) is the last layer's output
        before the final norm, which transformers' hidden_states[L] is not, and hooks keep no other layer's
        state. Captured, the copy is a kernel of the graph that replays into the same buffer: nothing at replay
        depends on Python, and no reference taken at capture is read after it."""
        handles = [self.layers[i - 1].register_forward_hook(self._tap_writer(k))
                   for k, i in enumerate(self.static_taps)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _tap_writer(self, k: int):
        h = self.config.hidden_size

        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output             # [1, b, h]
            self.tap_buffer[:, :out.shape[1], k * h:(k + 1) * h].copy_(out)
        return hook

    def taps_for(self, taps: tuple[int, ...]) -> WrittenTaps:
        """The next step's taps recorder (step_taps): LayerTaps' interface over tap_buffer."""
        self.tapped_rows = 0
        return WrittenTaps(taps, self.tap_features)

    def tap_features(self, taps: tuple[int, ...]) -> torch.Tensor:
        """The last step's rows of `taps` (each one of static_taps) side by side: [1, n, len(taps) * h], a copy (the
        next step overwrites the buffer)."""
        if not self.tapped_rows:
            raise RuntimeError("no step ran through this StaticDecoder since its taps were asked for")
        missing = [i for i in taps if i not in self.static_taps]
        if missing:
            raise ValueError(f"taps {missing} are not written by this StaticDecoder (its taps: {self.static_taps})")
        rows, h = self.tap_buffer[:, :self.tapped_rows], self.config.hidden_size
        if tuple(taps) == self.static_taps:
            return rows.clone()
        return torch.cat([rows[..., k * h:(k + 1) * h] for k in map(self.static_taps.index, taps)], dim=-1)


def static_unsupported(decoder, drafter) -> str | None:
    """Why the static step does not apply to this decoder and drafter, or None."""
    if getattr(decoder.config, "sliding_window", None):
        return "a sliding-window model (per-layer masks)"
    return None


def attach_static(state, drafter, max_new_tokens: int, capture: bool | None = None,
                  buckets: tuple[int, ...] = BUCKETS, fuse: str | None = "default") -> StaticDecoder | None:
    """Put a StaticDecoder and its StaticCache (loaded with the prefill's rows) into a DecodeState after prefill;
    capture: CUDA graphs (default: on a CUDA device); fuse: the torch.compile backend of the element-wise parts
    (models/engine/fused.py; "default": inductor where graphs are captured, None: unfused). -> the StaticDecoder,
    or None where it does not apply (the state stays eager). The drafter's taps are written into the
    StaticDecoder's tap_buffer (kept: one that writes them, or more)."""
    if static_unsupported(state.decoder, drafter):
        return None
    taps = tuple(int(i) for i in getattr(drafter, "taps", ()) or ())
    capture = state.device.type == "cuda" if capture is None else capture
    fuse = ("inductor" if capture else None) if fuse == "default" else fuse
    need = state.past + max_new_tokens + max(buckets) + 1
    static = _KEPT.get(state.decoder)
    if (static is None or static.cache.capacity < need or static.buckets != tuple(buckets)
            or static.mode != ("cuda_graphs" if capture else "static_eager")
            or not set(taps) <= set(static.static_taps)
            or (static.fused.backend if static.fused is not None else None) != fuse):
        capacity = -(-need // CAPACITY_STEP) * CAPACITY_STEP
        positions = torch.zeros(max(buckets), dtype=torch.long, device=state.device)
        static = StaticDecoder(state.decoder, StaticCache(len(state.cache.layers), capacity, positions), positions,
                               capture, buckets, taps, fuse)
        _KEPT[state.decoder] = static
    static.cache.load(state.cache)
    state.decoder, state.cache = static, static.cache
    return static


def static_summaries() -> list[dict]:
    """What each model's kept StaticDecoder did: its mode, the [verify size, span] pairs captured as graphs, and the
    pairs that fell back to the eager forward with the reason (for a benchmark's record; JSON-ready)."""
    return [{"mode": d.mode, "capacity": d.cache.capacity, "span_step": SPAN_STEP,
             "graphs": [list(k) for k in sorted(d.graphs)],
             "fallback": [[*k, why] for k, why in sorted(d.fallback.items())],
             "fused": d.fused.summary() if d.fused is not None else None} for d in list(_KEPT.values())]
