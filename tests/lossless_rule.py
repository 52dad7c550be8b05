"""Greedy outputs compared as the evaluation compares them (models/measure/ties.py): equal token for token, or
different first at a float tie of the base's dtype, measured in the 1-token and the verify shape. In float32
the tie floor is the evaluation's 1e-3, far above float32's rounding; in bf16 the dtype's rounding sets it."""
from __future__ import annotations

from models.measure.lossless import judged_difference

FLOOR = 1e-3       # conf/eval/mtbench.yaml's lossless_tie_tolerance


def assert_greedy_lossless(model, prompt: list[int], base, res, floor: float = FLOOR) -> dict | None:
    """base, res: GenerationResults of the baseline and of a speculative decode of `prompt`. Passes when the
    tokens are equal, or when their first difference is a tie; returns the tie's verdict (None when equal)."""
    entry = judged_difference(model, list(prompt), base.new_tokens, res.new_tokens, res.accept_lengths, floor)
    if entry is None:
        return None
    assert entry["tie"], (f"greedy output differs from the baseline at new token {entry['position']} (expected "
                          f"{entry['expected_token']}, got {entry['got_token']}), not a {entry['dtype']} tie: {entry}")
    return entry
