"""Which CPU paths a model decodes through, chosen by timing them on this machine, not by its flags.

    choice = measure_paths(model)     # PathChoice: packed body linears?, lean layers?, folded GQA?, the LM head's
    apply_paths(model, choice)        # path by rows

The same float32 products can run three ways on a CPU, and which is fastest depends on the machine. Measured in
place (a decoder forward after a 181-token prefix, SmolLM2-135M, 2 threads, ms, median):

    machine                         body 1 row: stock / packed    LM head, 1 row: linear / columns / packed
    2-core AMD EPYC, AVX2           packed faster                 columns fastest (17 against 19 for linear)
    2-core Intel Xeon, AMX          36-37 / 50                    3.4 / 11.3 / 2.8 (alone); 42 / 51 in a step

so the paths one machine needs slow the other by a fifth. A model too small to time (under MIN_MEASURED_BYTES of
weights: the tests' tiny ones) keeps DEFAULT, the paths measured fastest on the EPYC, so that its results never
hang on a timing.
"""
from __future__ import annotations

import itertools
import statistics
import time
import weakref
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from models.engine import fast_inference as fi
from models.engine import projection
from models.engine.kv_cache import cache_kwargs, new_cache
from models.engine.lean_layers import lean_layers_apply, stock_layers, use_lean_layers

MIN_MEASURED_BYTES = 32 << 20        # a model this small decodes in microseconds: its timings would be noise
LM_FEW = ("linear", "columns", "packed")          # up to projection.SMALL_BATCH rows
LM_MANY = ("linear", "onednn", "packed")          # more rows (a verify step's tree)


@dataclass(frozen=True)
class PathChoice:
    packed_body: bool = True         # the decoder's linears through oneDNN's packed weights (fi.pack_linears)
    folded_attention: bool = True    # GQA without the cache copy (fi.sdpa_gqa_folded), where the model runs SDPA
    lm_head_few: str = "packed"      # LM_FEW
    lm_head_many: str = "packed"     # LM_MANY
    lean_layers: bool = False        # Llama layers without transformers' module plumbing (lean_layers.py)
    measured: bool = False
    timings_ms: dict = field(default_factory=dict)    # option -> median ms, as measured

    def as_dict(self) -> dict:
        return asdict(self)


DEFAULT = PathChoice()
_APPLIED: "weakref.WeakKeyDictionary[torch.nn.Module, PathChoice]" = weakref.WeakKeyDictionary()


def applied_paths(model) -> dict | None:
    """The choice apply_paths last put `model` on, as a dict (what the latency record and run section report)."""
    choice = _APPLIED.get(model)
    return None if choice is None else choice.as_dict()


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def measurable(model) -> bool:
    p = next(model.parameters())
    return p.device.type == "cpu" and p.dtype == torch.float32 and fi.packing_available() \
        and weight_bytes(model) >= MIN_MEASURED_BYTES


def _median_ms(samples: list[float]) -> float:
    return round(1e3 * statistics.median(samples), 3)


class _Bench:
    """A prefix in a cache and a timed decoder forward of n rows after it (the rows cropped off again)."""

    def __init__(self, model, prefix: int, seed: int = 0):
        self.model, self.decoder = model, model.get_decoder()
        g = torch.Generator().manual_seed(seed)
        self.vocab = model.config.vocab_size
        self.ids = lambda n: torch.randint(self.vocab, (1, n), generator=g)
        self.cache, self.past = new_cache(), prefix
        self.decoder(input_ids=self.ids(prefix), use_cache=True, **cache_kwargs(self.decoder, self.cache))

    def forward(self, n: int, mask: bool = False) -> tuple[float, torch.Tensor]:
        kwargs = {}
        if mask:     # a tree verify's mask (a chain): every prefix column, the block causal
            block = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)
            kwargs["attention_mask"] = torch.cat([torch.zeros(n, self.past), block], 1)[None, None]
        ids, pos = self.ids(n), torch.arange(self.past, self.past + n)[None]
        t = time.perf_counter()
        hidden = self.decoder(input_ids=ids, position_ids=pos, use_cache=True, **cache_kwargs(self.decoder, self.cache),
                              **kwargs).last_hidden_state[0]
        seconds = time.perf_counter() - t
        self.cache.crop(-n)
        return seconds, hidden


def _lm_head_options(lm_head: torch.nn.Linear) -> dict:
    w, b = lm_head.weight, lm_head.bias
    packed = torch.ops.mkldnn._reorder_linear_weight(w.detach())
    onednn = projection.onednn_weights(lm_head)

    def columns(x):
        cols = torch.cat([x, x]) if x.shape[0] == 1 else x
        return (w @ cols.T)[:, :x.shape[0]].T

    return {"linear": lambda x: F.linear(x, w, b),
            "columns": columns,
            "packed": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], ""),
            "onednn": (lambda x: torch._C._nn.mkldnn_linear(x.to_mkldnn(), *onednn).to_dense()) if onednn else None}


@torch.inference_mode()
def measure_paths(model, prefix: int = 128, rows: int = 16, repeats: int = 7) -> PathChoice:
    """Time each option in place, interleaved round by round (so drift hits all alike), and keep the fastest:
    the body linears stock or packed, each with the stock or the lean layers where they apply, at 1 and `rows` rows
    (the sum of the two medians), GQA folded or not on a
    masked `rows`-row step, the LM head's three paths on 1 and on 2 x `rows` rows, each right after a 1-row
    forward (the caches as a step leaves them). About 100 forwards: seconds on a 2-core CPU."""
    bench, decoder = _Bench(model, prefix), model.get_decoder()
    lm_head = model.get_output_embeddings()
    attn = getattr(model.config, "_attn_implementation", None)
    fold_options = (False, True) if attn in ("sdpa", fi.GQA_FOLDED) and _has_grouped_heads(model) else (False,)
    lm = _lm_head_options(lm_head)
    t: dict[str, list[float]] = {}
    x_many = torch.randn(2 * rows, lm_head.in_features)
    leans = (False, True) if lean_layers_apply(model) else (False,)
    for rep in range(repeats + 1):                      # round 0 warms up
        samples = {}
        for packed, lean in itertools.product((False, True), leans):
            (fi.pack_linears if packed else fi.unpack_linears)(decoder)
            if not (lean and use_lean_layers(model)):
                stock_layers(model)
            for n in (1, rows):
                samples[f"body_{'packed' if packed else 'stock'}{'_lean' if lean else ''}_{n}"] = bench.forward(n)[0]
        stock_layers(model)
        for fold in fold_options:
            model.set_attn_implementation(fi.GQA_FOLDED if fold else "sdpa")
            samples[f"attention_{'folded' if fold else 'sdpa'}_{rows}"] = bench.forward(rows, mask=True)[0]
        for name in dict.fromkeys(LM_FEW + LM_MANY):
            if lm.get(name) is None:
                continue
            for n, x in ((1, None), (2 * rows, x_many)):
                if (n == 1 and name not in LM_FEW) or (n > 1 and name not in LM_MANY):
                    continue
                _, hidden = bench.forward(1)
                x = hidden[-1:] if x is None else x
                start = time.perf_counter()
                lm[name](x)
                samples[f"lm_head_{name}_{n}"] = time.perf_counter() - start
        if rep:
            for k, v in samples.items():
                t.setdefault(k, []).append(v)
    fi.unpack_linears(decoder)
    if attn is not None:
        model.set_attn_implementation(attn)
    ms = {k: _median_ms(v) for k, v in t.items()}
    body = {(p, lean): ms[f"body_{p}{'_lean' if lean else ''}_1"] + ms[f"body_{p}{'_lean' if lean else ''}_{rows}"]
            for p, lean in itertools.product(("stock", "packed"), leans)}
    packed, lean = min(body, key=body.get)
    folded = len(fold_options) == 2 and ms[f"attention_folded_{rows}"] < ms[f"attention_sdpa_{rows}"]
    few = min((n for n in LM_FEW if f"lm_head_{n}_1" in ms), key=lambda n: ms[f"lm_head_{n}_1"])
    many = min((n for n in LM_MANY if f"lm_head_{n}_{2 * rows}" in ms), key=lambda n: ms[f"lm_head_{n}_{2 * rows}"])
    return PathChoice(packed == "packed", folded, few, many, lean_layers=lean, measured=True, timings_ms=ms)


def _has_grouped_heads(model) -> bool:
    c = model.config
    return getattr(c, "num_key_value_heads", None) not in (None, getattr(c, "num_attention_heads", None))


def apply_paths(model, choice: PathChoice) -> dict:
    """Put `model` on `choice`'s paths; returns what prepare_for_decoding reports."""
    decoder, lm_head = model.get_decoder(), model.get_output_embeddings()
    n = fi.pack_linears(decoder) if choice.packed_body else (fi.unpack_linears(decoder) or 0)
    if "packed" in (choice.lm_head_few, choice.lm_head_many) and isinstance(lm_head, torch.nn.Linear):
        n += fi.pack_linears(lm_head)
    elif isinstance(lm_head, torch.nn.Linear):
        fi.unpack_linears(lm_head)
    if isinstance(lm_head, torch.nn.Linear):
        projection.set_paths(lm_head, choice.lm_head_few, choice.lm_head_many)
    fi.own_linears(model)
    lean = choice.lean_layers and use_lean_layers(model)
    if not lean:
        stock_layers(model)
    attention = getattr(model.config, "_attn_implementation", None)
    if choice.folded_attention and fi.use_folded_gqa(model):
        attention = fi.GQA_FOLDED
    elif attention == fi.GQA_FOLDED:
        model.set_attn_implementation("sdpa")
        attention = "sdpa"
    _APPLIED[model] = choice
    return {"packed_linears": n, "attention": attention, "lean_layers": lean, "paths": choice.as_dict()}


def prepare_for_decoding(model, paths: PathChoice | None = None) -> dict:
    """The CPU speed-ups of models.engine.fast_inference where they apply (CPU float32 for the linears, SDPA models
    for the attention) and pay on this machine: paths None: measured here (measure_paths, seconds), or DEFAULT for
    a model too small to time. Returns {"packed_linears", "attention", "lean_layers", "paths"}."""
    if paths is None:
        paths = measure_paths(model) if measurable(model) else DEFAULT
    return apply_paths(model, paths)


def stock_copy(model):
    """A copy of `model` that decodes through transformers' own paths (nn.Linear, its layers and attention), whether
    or not `model` was prepared: what transformers' generate runs on when it is the reference loop."""
    import copy

    twin = copy.deepcopy(model)
    fi.unpack_linears(twin)
    stock_layers(twin)
    if getattr(twin.config, "_attn_implementation", None) == fi.GQA_FOLDED:
        twin.set_attn_implementation("sdpa")
    return twin
