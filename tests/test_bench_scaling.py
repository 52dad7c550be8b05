"""pipelines.bench.scaling's collection: points per family and data size, ratios and slopes per doubling."""
import json
import math

import pytest
from omegaconf import OmegaConf

from analysis.plots import plot_data_scaling
from pipelines.bench import scaling as B


def write(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def add_point(results, reports, heads, targets, accept):
    write(reports / "metrics" / f"train_{heads}.json",
          {"train_examples": targets // 100, "train_targets_head0": targets, "epochs": 2,
           "val_top1": {"head0": 0.3}, "wall_time_s": 1.0})
    write(results / "calibrate" / heads / "calibration.json",
          {"budgets": [{"budget": b, "replay_accept_length": a} for b, a in accept.items()]})


def test_collect_ratios_and_slopes(tmp_path):
    s = {**B.DEFAULTS, "heads": ["ref", "new"], "samples": [100, 200], "root": str(tmp_path / "probe")}
    cfg = OmegaConf.create({"paths": {"results": str(tmp_path / "results"), "reports": str(tmp_path / "reports")}})
    # ref stays flat; new gains 0.1 accepted tokens per doubling of its data
    for n, targets, new in ((100, 1000, 1.4), (200, 2000, 1.5)):
        f = B.folders(s["root"], n)
        add_point(f["results"], f["reports"], "ref", targets, {4: 1.5, 16: 2.0})
        add_point(f["results"], f["reports"], "new", targets, {4: new, 16: 2.0})
    add_point(tmp_path / "results", tmp_path / "reports", "ref", 4000, {4: 1.5, 16: 2.0})
    add_point(tmp_path / "results", tmp_path / "reports", "new", 4000, {4: 1.6, 16: 2.0})
    record = B.collect(cfg, s)
    assert list(record["families"]["new"]["points"]) == ["100", "200", "all"]
    assert record["families"]["new"]["slope_per_doubling"]["4"] == pytest.approx(0.1)
    assert record["families"]["ref"]["slope_per_doubling"] == {"4": 0.0, "16": 0.0}
    ratio = record["ratios"]["new_over_ref"]
    assert ratio["by_data"]["all"]["by_budget"] == {"4": pytest.approx(1.6 / 1.5, abs=1e-4), "16": 1.0}
    assert ratio["slope_per_doubling"]["4"] == pytest.approx(0.1 / 1.5, abs=1e-3)
    # from 1.067x at the full data, 0.067 a doubling: 2.75 doublings to 1.25x; a flat ratio never gets there
    assert ratio["doublings_to_1.25"] == {"4": pytest.approx(2.75, abs=0.06), "16": None}
    assert "+scaling.samples=[100,200]" in record["command"]
    assert plot_data_scaling(record, tmp_path / "scaling.png").stat().st_size > 0


def test_missing_points_are_left_out(tmp_path):
    s = {**B.DEFAULTS, "heads": ["ref", "new"], "samples": [100], "root": str(tmp_path / "probe")}
    cfg = OmegaConf.create({"paths": {"results": str(tmp_path / "results"), "reports": str(tmp_path / "reports")}})
    f = B.folders(s["root"], 100)
    add_point(f["results"], f["reports"], "ref", 1000, {4: 1.5})        # "new" never trained at n=100
    record = B.collect(cfg, s)
    assert record["families"]["new"]["points"] == {}
    assert record["ratios"]["new_over_ref"]["by_data"] == {}


def test_slope_per_doubling():
    assert B.slope_per_doubling([1, 2, 4], [1.0, 1.5, 2.0]) == pytest.approx(0.5)
    assert B.slope_per_doubling([3], [1.0]) is None
    assert math.isclose(B.slope_per_doubling([1, 4], [2.0, 1.0]), -0.5)


def test_bad_settings_name_the_value():
    cfg = OmegaConf.create({"scaling": {"samples": [0, 10]}})
    with pytest.raises(ValueError, match=r"scaling.samples=\[0, 10\]"):
        B.settings_of(cfg)


def test_run_one_reuses_the_base_model_caches_and_skips_finished_steps(tmp_path, monkeypatch):
    main = tmp_path / "main"
    (main / "cache" / "calibrate").mkdir(parents=True)
    (main / "cache" / "calibrate" / "continuations.json").write_text("{}")
    (main / "calibrate").mkdir()
    (main / "calibrate" / "latency.json").write_text("{}")
    calls = []
    monkeypatch.setattr(B.subprocess, "run", lambda args, **kw: calls.append(args[2:4]))
    cfg = OmegaConf.create({"paths": {"results": str(main)}})
    B.run_one(cfg, "eagle3", 10, str(tmp_path / "probe"))
    f = B.folders(str(tmp_path / "probe"), 10)
    assert (f["results"] / "cache" / "calibrate" / "continuations.json").is_file()
    assert (f["results"] / "calibrate" / "latency.json").is_file()
    assert calls == [["pipelines.train", "heads=eagle3"], ["pipelines.calibrate", "heads=eagle3"]]
    add_point(f["results"], f["reports"], "eagle3", 1000, {4: 1.5})        # both steps' outputs now exist
    calls.clear()
    B.run_one(cfg, "eagle3", 10, str(tmp_path / "probe"))
    assert calls == []
