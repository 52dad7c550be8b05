"""pytest tests/test_bench_wait.py: the wait-policy benchmark's pairing and arithmetic (pipelines/bench/wait_policy.py).
No timings are asserted."""
from __future__ import annotations

import pytest

from pipelines.bench.wait_policy import compare


def one_round(default: dict, passive: dict) -> dict:
    return {"results": {name: {"question_ids": [81, 82, 83], "ms_per_step": ms}
                        for name, ms in (("default", default), ("passive", passive))}}


def test_each_policy_is_paired_with_the_first_by_round_and_question():
    runs = [one_round({"baseline": [100, 110, 90], "tree": [200, 220, 180]},
                      {"baseline": [125, 137.5, 112.5], "tree": [220, 242, 198]}),
            one_round({"baseline": [80, 80, 80], "tree": [160, 160, 160]},
                      {"baseline": [100, 100, 100], "tree": [176, 176, 176]})]
    out = compare(runs, ["default", "passive"])["passive"]
    assert out["baseline"]["pairs"] == 6 and out["baseline"]["ms_ratio"] == pytest.approx(1.25)
    assert out["tree"]["ms_ratio"] == pytest.approx(1.10)
    assert out["baseline"]["interval"] == pytest.approx([1.25, 1.25])           # every pair the same ratio
    assert out["speedup_bias"] == pytest.approx(1.25 / 1.10)       # the baseline slowed more: speedups read higher
