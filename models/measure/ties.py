"""When a greedy difference is a float tie: the tolerance follows the base's dtype and the two logits' magnitude,
and the margin is measured in the two forward shapes that can disagree.

    tol = tie_tolerance(torch.bfloat16, 12.3, 12.2, floor=1e-3)      # 2 bf16 steps at 12.3: 0.125
    m = shape_margins(model, prompt, reference, position, other, step_start)
    # {"one_token": .., "verify": ..}: reference[position]'s logit minus other's, in the baseline's 1-token step
    # and in a multi-row verify-shaped forward
    verdict = judge_difference(model, prompt, reference, position, other, step_start, floor=1e-3)

A verify forward over several rows and a 1-token forward reduce in other orders (other kernels), so their logits
differ by a few rounding steps of the dtype; where the base's two best tokens are that close, greedy may pick
either. float32 rounds in steps of ~1e-7 relative, far below the absolute floor (1e-3), so it stays as strict as
an absolute rule; bf16 keeps 8 significant bits, so logits of magnitude 8-16 round in steps of 0.0625.
"""
from __future__ import annotations

import math

import torch

from models.engine.kv_cache import cache_kwargs, new_cache
from models.engine.projection import base_logits

TIE_STEPS = 2          # a tie: both shapes' margins within two rounding steps of the dtype at the logits' size
VERIFY_ROWS = 8        # the verify-shaped forward has at least this many rows (the tree's other rows are not kept)


def rounding_step(dtype: torch.dtype, magnitude: float) -> float:
    """The spacing of `dtype`'s numbers at |magnitude| (one unit in the last place)."""
    if not dtype.is_floating_point:
        raise ValueError(f"dtype {dtype} has no rounding step: a floating-point dtype is needed")
    m = abs(float(magnitude))
    exponent = math.floor(math.log2(m)) if m > 0 else torch.finfo(dtype).minexp
    return torch.finfo(dtype).eps * 2.0 ** exponent


def tie_tolerance(dtype: torch.dtype, a: float, b: float, floor: float) -> float:
    """The largest margin between logits a and b still called a tie: TIE_STEPS rounding steps of the dtype at the
    larger magnitude, and never less than `floor` (the configured absolute tolerance; 0 keeps the dtype's alone)."""
    if floor < 0:
        raise ValueError(f"tie tolerance floor {floor!r}: must be >= 0 (0 = the dtype's rounding alone)")
    return max(float(floor), TIE_STEPS * rounding_step(dtype, max(abs(a), abs(b))))


def _forward(decoder, logits_fn, cache, ids: list[int], start: int) -> torch.Tensor:
    """Rows `ids` at positions start.. through the decoder over `cache` -> their logits [R, V] (float32)."""
    device = cache_device(decoder)
    hidden = decoder(input_ids=torch.tensor([ids], device=device),
                     position_ids=torch.arange(start, start + len(ids), device=device)[None],
                     use_cache=True, **cache_kwargs(decoder, cache)).last_hidden_state[0]
    return logits_fn(hidden).float()


def cache_device(decoder) -> torch.device:
    return next(decoder.parameters()).device


@torch.inference_mode()
def shape_margins(model, prompt: list[int], reference: list[int], position: int, other: int,
                  step_start: int) -> dict:
    """reference[position]'s logit minus other's, in the two shapes: "one_token", the baseline's own path (the
    prompt in one forward, then one token a step); "verify", the method's step that emitted `position` (it
    started with new tokens [0, step_start) emitted): the context up to the step's root in one forward, then the
    step's rows from the root on, padded with the reference's next tokens to VERIFY_ROWS rows. Also the logits
    of both tokens in each shape (for the tolerance)."""
    decoder, logits_fn = model.get_decoder(), base_logits(model)
    want, out = reference[position], {}
    cache = new_cache()
    row = _forward(decoder, logits_fn, cache, prompt, 0)[-1]
    for t in range(position):
        row = _forward(decoder, logits_fn, cache, [reference[t]], len(prompt) + t)[0]
    out["one_token"] = (float(row[want]), float(row[other]))
    if step_start < 1:                                   # the prefill's token: both ran the same forward
        out["verify"] = out["one_token"]
    else:
        cache, root = new_cache(), step_start - 1
        _forward(decoder, logits_fn, cache, prompt + reference[:root], 0)
        rows = reference[root:max(position, root + VERIFY_ROWS)]
        row = _forward(decoder, logits_fn, cache, rows, len(prompt) + root)[position - step_start]
        out["verify"] = (float(row[want]), float(row[other]))
    return out


def step_start_of(accept_lengths: list[int], position: int) -> int:
    """How many new tokens were emitted before the step that emitted new token `position` (the prefill emits
    token 0; step i emits accept_lengths[i])."""
    if position < 1:
        return 0
    emitted = 1
    for a in accept_lengths:
        if emitted + a > position:
            return emitted
        emitted += a
    return emitted


def judge_difference(model, prompt: list[int], reference: list[int], position: int, other: int | None,
                     step_start: int, floor: float) -> dict:
    """The verdict on a greedy difference at new-token `position`: a tie when, in both shapes, the two logits
    differ by at most the dtype's tolerance at their magnitude. A length difference (other None) is never a tie."""
    dtype = model.get_output_embeddings().weight.dtype
    if other is None or position >= len(reference):
        return {"tie": False, "dtype": str(dtype).replace("torch.", ""), "margins": None, "tolerance": None}
    logits = shape_margins(model, prompt, reference, position, other, step_start)
    margins = {shape: a - b for shape, (a, b) in logits.items()}
    tol = max(tie_tolerance(dtype, a, b, floor) for a, b in logits.values())
    return {"tie": all(abs(m) <= tol for m in margins.values()), "dtype": str(dtype).replace("torch.", ""),
            "margins": margins, "tolerance": tol}
