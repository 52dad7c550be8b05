"""The results document's GPU projection (analysis/projection.py): published accepted tokens a step over this
decoder's step cost from a bench file, beside the published speedup; checked on a small hand-made bench file."""
from __future__ import annotations

import json

import pytest

from analysis.projection import projection_markdown, projection_rows, projection_section

BENCH = {"device": "Test GPU", "date": "2026-11-26", "dtype": "bfloat16", "decoder_commit": "abc1234",
         "shapes": {"vicuna_7b": {"settings": {"host_settings": {
             "host": {"threads": 1, "cudnn_attention": False}, "plain_step_ms": 20.0,
             "verify": {"sizes": [1, 16, 64], "relative": [1.0, 0.9, 1.2], "one_token_ms": 21.0},
             "drafting": {"medusa": {"heads": "medusa1", "sparse64": {"step_ms": 25.0}}}}}}}}


def test_each_published_result_is_its_accepted_length_over_our_step_cost():
    rows = {r["method"]: r for r in projection_rows(BENCH)}
    assert list(rows) == ["medusa1", "medusa2", "hydra", "hydra_pp", "eagle", "eagle2", "eagle3", "dflash"]
    m1 = rows["medusa1"]                           # Medusa's own step on the 63-node tree: 25 / 20 plain-step ms
    assert (m1["basis"], m1["step_cost"], m1["accepted"], m1["published_speedup"]) == ("measured step", 1.25, 2.57, 2.18)
    assert m1["projected_speedup"] == pytest.approx(2.57 / 1.25)
    hydra = rows["hydra"]                          # no Hydra step in the file: the 64-token verify alone
    assert (hydra["basis"], hydra["step_cost"]) == ("verify only", 1.2)
    assert hydra["projected_speedup"] == pytest.approx(3.04 / 1.2)
    eagle2 = rows["eagle2"]                        # a 60-token tree: between the 16- and 64-token verify
    assert eagle2["step_cost"] == pytest.approx(0.9 + 0.3 * 44 / 48)
    assert eagle2["projected_speedup"] == pytest.approx(4.34 / eagle2["step_cost"])
    assert rows["medusa2"]["accepted"] is None and rows["medusa2"]["projected_speedup"] is None
    assert rows["medusa2"]["published_speedup"] == 2.83


def test_the_section_says_it_is_a_projection_and_names_its_file(tmp_path):
    path = tmp_path / "reports" / "bench" / "gpu_test.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(BENCH))
    text = projection_markdown("reports/bench/gpu_test.json", tmp_path)
    assert text == projection_section(BENCH, "reports/bench/gpu_test.json")
    assert "not a reproduction" in text and "`reports/bench/gpu_test.json`" in text and "Test GPU" in text
    assert "abc1234" in text and "1 host thread(s), cuDNN attention off" in text
    line = next(r for r in text.splitlines() if r.startswith("| Medusa-1 |"))
    assert line == "| Medusa-1 | Vicuna-7B, A100 (paper) | 2.57 | 63-node (64) | 1.25 | measured step | 2.06x | 2.18x |"
    assert "upper bound" in text and "Medusa-2: no published accepted length" in text
    assert projection_markdown("reports/bench/none.json", tmp_path) is None


def test_a_bench_file_without_the_shape_is_refused_naming_what_it_has():
    with pytest.raises(ValueError, match="vicuna_7b.*tiny"):
        projection_rows({"shapes": {"tiny": {"settings": {}}}})


def test_the_drafts_replayed_as_graphs_are_preferred_to_the_same_step_with_eager_drafts():
    def setting(step_ms: float, static_drafts: bool) -> dict:
        return {"host": {"threads": 1, "cudnn_attention": False, "static_step": True, "static_drafts": static_drafts},
                "plain_step_ms": 10.0, "verify": {"sizes": [1, 64], "relative": [1.0, 1.1], "one_token_ms": 10.0},
                "drafting": {"medusa": {"heads": "medusa1", "sparse64": {"step_ms": step_ms}}}}
    bench = dict(BENCH, shapes={"vicuna_7b": {"settings": {"static_step": setting(14.0, False),
                                                           "static_drafts": setting(12.0, True)}}})
    m1 = next(r for r in projection_rows(bench) if r["method"] == "medusa1")
    assert (m1["basis"], m1["step_cost"]) == ("measured step", 1.2)                 # 12 / 10, not 14 / 10
    assert m1["projected_speedup"] == pytest.approx(2.57 / 1.2)
    assert projection_rows(bench, setting="static_step")[0]["step_cost"] == 1.4
    text = projection_section(bench, "reports/bench/gpu_test.json")
    assert "each fixed tree's draft replayed as a CUDA graph" in text and "a plain step 10.0 ms" in text


def test_the_batch_cost_table_reads_the_batched_verify_step_beside_sglangs_rows():
    from analysis.projection import batch_cost_section

    bench = {"shapes": {"vicuna_7b": {"settings": {"host_settings": {"batch_verify": {
        "batch_sizes": [1, 8, 64], "sizes": [1, 4, 16, 64],
        "relative": [[1.0, 1.02, 1.1, 1.4], [1.0, 1.1, 1.5, 2.9], [1.0, 2.0, 5.5, 19.0]]}}}}}}
    lines = batch_cost_section(bench).splitlines()
    assert lines[-1] == "| 64 | 2.00 | 5.50 | 19.00 | 2.00x | 1.38x | - |"
    assert lines[-2] == "| 8 | 1.10 | 1.50 | 2.90 | 3.64x | 1.62x | - |"
    assert batch_cost_section({"shapes": {"vicuna_7b": {"settings": {"host_settings": {}}}}}) is None
