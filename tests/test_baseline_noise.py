"""pipelines/bench/baseline_noise.py's reading of a shared baseline corrected per stage, on made-up runs."""
from __future__ import annotations

import pytest

from pipelines.bench.baseline_noise import corrected


def rows(base_time: float, wobble: float = 0.0) -> dict[str, dict]:
    """10 questions: the method twice as fast as a baseline of base_time s (question q's off by wobble * (q % 3 - 1))."""
    out = {}
    for q in range(10):
        t = base_time * (1 + wobble * (q % 3 - 1))
        out[str(100 + q)] = {"tokens": 64, "time": t / 2, "base_tokens": 64, "base_time": t, "decode_tokens": 63,
                             "decode_time": t / 2, "base_decode_tokens": 63, "base_decode_time": t,
                             "speedup": 2.0, "decode_speedup": 2.0, "steps": 32, "emitted": 64}
    return out


def test_a_uniform_drift_is_corrected_away_from_a_few_questions():
    """Run b's machine 10% faster throughout: its method over run a's baseline reads 2.2x; corrected by the drift 4
    of its own baseline's questions show, 2.0x, as over its own baseline, with no residual elsewhere."""
    a, b = rows(1.0), rows(1 / 1.1)
    c = corrected(a, b, 4)
    assert c["questions_measured"] == 4 and c["drift_factor"] == pytest.approx(1.1)
    assert c["corrected_baseline"]["value"] == pytest.approx(2.0) == c["own_baseline"]["value"]
    assert c["residual_log"]["mean"] == pytest.approx(0.0, abs=1e-12)


def test_what_the_correction_cannot_follow_stays_in_its_residual():
    """Question-by-question noise in run b's baseline is not a drift: the factor averages it, the residual shows it."""
    c = corrected(rows(1.0), rows(1.0, wobble=0.05), 3)
    assert c["residual_log"]["stdev"] > 0.03
    assert c["corrected_baseline"]["value"] != pytest.approx(c["own_baseline"]["value"], abs=1e-6)
