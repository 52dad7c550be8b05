"""Greedy outputs compared as the evaluation compares them (models/measure/ties.py): equal token for token, or
different first at a float tie of the base's dtype, measured in the 1-token and the verify shape. In float32
the tie floor is the evaluation's 1e-3, far above float32's rounding; in bf16 the dtype's rounding sets it."""
from __future__ import annotations

from models.measure.benchmark import first_difference
from models.measure.ties import judge_difference, step_start_of

FLOOR = 1e-3       # conf/eval/mtbench.yaml's lossless_tie_tolerance


def assert_greedy_lossless(model, prompt: list[int], base, res, floor: float = FLOOR) -> dict | None:
    """base, res: GenerationResults of the baseline and of a speculative decode of `prompt`. Passes when the
    tokens are equal, or when their first difference is a tie; returns the tie's verdict (None when equal)."""
    pos = first_difference(base.new_tokens, res.new_tokens)
    if pos is None:
        return None
    got = res.new_tokens[pos] if pos < len(res.new_tokens) else None
    verdict = judge_difference(model, list(prompt), base.new_tokens, pos, got,
                               step_start_of(res.accept_lengths, pos), floor)
    assert verdict["tie"], (f"greedy output differs from the baseline at new token {pos} (expected "
                            f"{base.new_tokens[pos] if pos < len(base.new_tokens) else None}, got {got}), not a "
                            f"{verdict['dtype']} tie: {verdict}")
    return verdict
