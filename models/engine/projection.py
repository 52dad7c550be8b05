"""LM-head products for few rows, fast on a CPU: the baseline step, the verify step and the draft heads.

    logits = project(model.get_output_embeddings(), hidden)     # hidden [R, h] -> [R, V], = linear(hidden)
    logits = base_logits(model)(hidden)     # the model's own logits: the same, then its forward's transform
                                            # (Granite's scaling, Cohere's scale, Gemma-2's soft-cap), if any

A 49152 x 576 LM head is a fifth of SmolLM2's weights, and nn.Linear's x @ W.T runs badly on MKL
for a handful of rows. Measured on a 2-core AMD EPYC with AVX2 (1 thread, ms, median):

    rows        1     4     10    22    64
    nn.Linear   19    31    39    63    119
    W @ x.T     17    13    46    76    106
    oneDNN      14    20    25    36    81     (weights packed once, torch._C._nn.mkldnn_linear)

so up to 8 rows go as W @ x.T (one row as two columns) and more rows through oneDNN with a packed
copy of the weights (cached per layer, re-packed if the weights change). Other devices, dtypes
and modules use the module itself. Which path is fastest differs by machine (on a 2-core AMX Xeon nn.Linear
takes 3.4 ms for one row, W @ x.T 11.3): models/engine/path_choice.py times them and records its pick (set_paths).
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from models.engine.fast_inference import is_packed

SMALL_BATCH = 8
_packed: "weakref.WeakKeyDictionary[torch.nn.Linear, tuple]" = weakref.WeakKeyDictionary()
# LM head -> (path for up to SMALL_BATCH rows, path for more), as models.engine.path_choice measured them
_paths: "weakref.WeakKeyDictionary[torch.nn.Linear, tuple[str, str]]" = weakref.WeakKeyDictionary()


def set_paths(linear: torch.nn.Linear, few: str, many: str) -> None:
    """few: "linear" | "columns" | "packed"; many: "linear" | "onednn" | "packed" (path_choice.LM_FEW, LM_MANY)."""
    _paths[linear] = (few, many)


def onednn_weights(linear: torch.nn.Linear):
    """(mkldnn weight, mkldnn bias) of linear, packed once per weight version; None where oneDNN is missing."""
    w = linear.weight
    key = (w.data_ptr(), w._version)
    hit = _packed.get(linear)
    if hit is not None and hit[0] == key:
        return hit[1]
    try:
        bias = linear.bias if linear.bias is not None else torch.zeros(w.shape[0], dtype=w.dtype)
        packed = (w.detach().to_mkldnn(), bias.detach().to_mkldnn())
    except (RuntimeError, AttributeError):
        packed = None
    _packed[linear] = (key, packed)
    return packed


def project(linear, x: torch.Tensor) -> torch.Tensor:
    """linear(x) for x [R, h] -> [R, V] (same values up to float rounding), by the path measured fastest for
    this many rows where one was (set_paths), else: packed, or columns up to SMALL_BATCH rows and oneDNN above."""
    paths = _paths.get(linear)
    if paths is None and is_packed(linear):     # prepared by models.engine.fast_inference: its own fast path
        return linear(x.to(linear.weight.dtype))
    if not (isinstance(linear, torch.nn.Linear) and x.device.type == "cpu" and linear.weight.dtype == torch.float32):
        # float32 heads on a bf16 base's shared LM head (GPU profiles): the product in the weights' dtype
        return linear(x.to(linear.weight.dtype)) if isinstance(linear, torch.nn.Linear) else linear(x)
    x = x.to(torch.float32)
    R = x.shape[0]
    kind = (paths[0] if R <= SMALL_BATCH else paths[1]) if paths else ("columns" if R <= SMALL_BATCH else "onednn")
    if kind == "packed" and is_packed(linear):
        return linear(x)
    if kind in ("linear", "packed"):
        return F.linear(x, linear.weight, linear.bias)
    if kind == "columns":
        cols = torch.cat([x, x]) if R == 1 else x
        out = (linear.weight @ cols.T)[:, :R].T                               # [R, V], a column-major view
        return out if linear.bias is None else out + linear.bias
    packed = onednn_weights(linear)
    if packed is None:
        return linear(x)
    return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), *packed).to_dense()


# -- the base model's own logits ---------------------------------------------------------------------
# Config settings by which a causal LM's forward transforms lm_head's output, in the order it applies them,
# each as transformers writes it (op, setting, architecture): one place to add a new one.
LOGIT_TRANSFORMS = (("divide", "logits_scaling", "Granite"), ("multiply", "logit_scale", "Cohere"),
                    ("softcap", "final_logit_softcapping", "Gemma-2"))


def logit_transform(config) -> tuple[tuple[str, str, float], ...]:
    """(op, setting, value) of every transform the config turns on; () for a plain lm_head (Llama, SmolLM2)."""
    steps = []
    for op, name, _ in LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value is not None and not (op != "softcap" and value == 1):
            steps.append((op, name, float(value)))
    return tuple(steps)


class BaseLogits:
    """hidden [R, h] -> the base model's next-token logits [R, V]: project(lm_head), then the model's transform
    of them, with the ops its forward uses (lossless sampling needs its distribution, not lm_head's)."""

    def __init__(self, lm_head, steps: tuple[tuple[str, str, float], ...] = ()):
        self.lm_head, self.steps = lm_head, steps

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = project(self.lm_head, hidden)
        return self.transform(logits) if self.steps else logits    # no transform: no extra op

    def transform(self, logits: torch.Tensor) -> torch.Tensor:
        for op, _, value in self.steps:
            if op == "divide":
                logits = logits / value
            elif op == "multiply":
                logits = logits * value
            else:
                logits = torch.tanh(logits / value) * value
        return logits

    def describe(self) -> str:
        return " then ".join(f"{op} by {name}={value:g}" for op, name, value in self.steps) or "no transform"


# model -> ((lm_head id, steps), BaseLogits): built and checked once per model, again if its settings change
_checked: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def base_logits(model) -> BaseLogits:
    """The engine's logits for `model`, checked once against model(input_ids).logits (check_base_logits)."""
    lm_head = model.get_output_embeddings()
    steps = logit_transform(model.config)
    hit = _checked.get(model)
    if hit is not None and hit[0] == (id(lm_head), steps):
        return hit[1]
    fn = BaseLogits(lm_head, steps)
    check_base_logits(model, fn)
    _checked[model] = ((id(lm_head), steps), fn)
    return fn


@torch.inference_mode()
def check_base_logits(model, fn: BaseLogits, n: int = 4) -> None:
    """Raise ValueError when fn(last hidden states) is not the model's own output on n tokens: an architecture
    whose logits the engine cannot reproduce is refused rather than sampled from the wrong distribution."""
    vocab = fn.lm_head.weight.shape[0]
    ids = torch.linspace(1, vocab - 1, n).long().to(fn.lm_head.weight.device)[None]
    ref = model(input_ids=ids, use_cache=False).logits[0]
    rel = 1e-3 if ref.dtype == torch.float32 else 3e-2                 # float rounding, not a transform
    ref = ref.float()
    ours = fn(model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0]).float()
    diff = float((ref - ours).abs().max())
    if not diff <= rel * max(1.0, float(ref.abs().max())):        # NaN fails too
        known = ", ".join(f"{name} ({arch})" for _, name, arch in LOGIT_TRANSFORMS)
        raise ValueError(
            f"{type(model).__name__} (model_type {model.config.model_type!r}): its own logits differ by up to "
            f"{diff:.3g} from the engine's (lm_head of the decoder's last hidden state, {fn.describe()}), so its "
            f"forward transforms them in a way the engine does not reproduce; refusing to decode it. The engine "
            f"knows the config settings {known}")
