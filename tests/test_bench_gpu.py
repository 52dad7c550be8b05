"""`make bench-gpu` (pipelines/bench/gpu.py) on the CPU with the tiny shape: the file it writes has the device,
versions, date and commit, and every figure for both host settings. No timing is asserted."""
from __future__ import annotations

import json

import pytest
import torch


def test_bench_gpu_writes_every_figure_for_the_tiny_shape(compose_cfg, tmp_path):
    from pipelines.bench.gpu import run_bench

    cfg = compose_cfg("+bench_gpu.sizes=[1,4,16]", "+bench_gpu.repeats=1", "+bench_gpu.new_tokens=6",
                      "+bench_gpu.prefix_len=24", "+bench_gpu.families=[medusa,eagle]", "+bench_gpu.device=cpu",
                      "+bench_gpu.profile_step=true", "+bench_gpu.batch_tree_sizes=[1,4]")
    path, record = run_bench(cfg)
    assert path == tmp_path / "reports" / "bench" / "gpu_cpu.json"
    assert json.loads(path.read_text()) == record
    assert record["device"] == "cpu" and record["torch"] == torch.__version__ and record["transformers"]
    assert record["date"] and record["decoder_commit"] and record["weights"] == "random"
    assert list(record["shapes"]) == ["tiny"] and record["bench_settings"]["dtype"] == "float32"
    rows = record["shapes"]["tiny"]["settings"]
    assert list(rows) == ["torch_defaults", "host_settings", "static_step", "static_drafts"]
    assert record["shapes"]["tiny"]["complete"]
    for name in ("static_step", "static_drafts"):
        assert rows[name]["plain_tokens_equal_host_settings"]     # a CPU: the same eager step twice
    for name, row in rows.items():
        assert row["host_record"]["host_settings"] == {}          # a CPU: the host settings change nothing
        assert row["plain_step_ms"] > 0 and row["hf_generate_ms_per_token"] > 0 and row["seconds"] > 0
        assert ("hf_generate_static_ms_per_token" in row) == (name == "static_drafts")     # bench_gpu.hf_static_in
        assert row["verify"]["sizes"] == [1, 4, 16] and row["verify"]["relative"][0] == 1.0
        assert row["verify"]["one_token_ms"] > 0
        if name == "host_settings":          # the batched verify step against B, once (a batch decodes eagerly)
            bv = row["batch_verify"]
            assert bv["batch_sizes"] == [1, 2, 4, 8] and len(bv["ms"]) == 4 and bv["relative"][2][0] == 1.0
        else:
            assert "batch_verify" not in row
        assert row["step_profile"]["tokens"] == 6 and row["step_profile"]["device_busy_ms"] is None   # a CPU
        assert ("hf_static_step_profile" in row) == (name == "static_drafts")
        assert set(row["drafting"]) == {"medusa", "eagle"}
        for family in row["drafting"].values():
            for tree in ("sparse64", "chain4", "eagle2"):
                parts = family[tree]
                assert parts["step_ms"] > 0 and parts["draft_ms"] > 0 and parts["verify_ms"] > 0
                assert parts["tokens_per_step"] >= 1
            for tree in ("sparse64", "chain4"):                   # a CPU: no graph, and the file says why
                assert family[tree]["draft_graph"]["mode"] == "eager" and family[tree]["draft_graph"]["fallback"]


@pytest.mark.parametrize("override,match", [("+bench_gpu.shapes=[llama_70b]", "llama_70b"),
                                            ("+bench_gpu.sizes=[4,8]", "must include 1"),
                                            ("+bench_gpu.repeat=3", "bench_gpu.repeat "),
                                            ("+bench_gpu.settings=[fast]", "bench_gpu.settings")])
def test_bench_gpu_refuses_unknown_settings(compose_cfg, override, match):
    from pipelines.bench.gpu import settings_of

    with pytest.raises(ValueError, match=match):
        settings_of(compose_cfg(override))


def test_bench_gpu_judges_a_static_step_difference_by_the_tie_rule(compose_cfg, monkeypatch):
    """Where the static step's plain tokens differ from the eager ones, the file says where and whether it is a tie
    (here a flipped token on a float32 model: a real difference, its margin measured)."""
    from pipelines.bench import gpu

    real = gpu.measure_setting

    def flipped(cfg, model, s, setting, static):
        row = real(cfg, model, s, setting, static)
        if setting == "static_step":
            row["plain_tokens"] = row["plain_tokens"][:2] + [(row["plain_tokens"][2] + 1) % 7] + row["plain_tokens"][3:]
        return row

    monkeypatch.setattr(gpu, "measure_setting", flipped)
    cfg = compose_cfg("+bench_gpu.sizes=[1,4]", "+bench_gpu.repeats=1", "+bench_gpu.new_tokens=6",
                      "+bench_gpu.prefix_len=24", "+bench_gpu.families=[medusa]", "+bench_gpu.trees=[chain4]",
                      "+bench_gpu.settings=[host_settings,static_step]", "+bench_gpu.device=cpu")
    _, record = gpu.run_bench(cfg)
    rows = record["shapes"]["tiny"]["settings"]
    assert list(rows) == ["host_settings", "static_step"] and record["shapes"]["tiny"]["complete"]
    diff = rows["static_step"]["plain_difference"]
    assert rows["static_step"]["plain_tokens_equal_host_settings"] is False
    assert diff["position"] == 2 and diff["tie"] is False and diff["dtype"] == "float32"
    assert abs(diff["logit_margin"]) > diff["tolerance"]
    assert rows["static_step"]["verify"]["sizes"] == [1, 4]


def test_bench_gpu_profiles_drafting_when_asked(compose_cfg):
    from pipelines.bench.gpu import run_bench

    cfg = compose_cfg("+bench_gpu.sizes=[1,4]", "+bench_gpu.repeats=1", "+bench_gpu.new_tokens=4",
                      "+bench_gpu.prefix_len=16", "+bench_gpu.families=[medusa,eagle]", "+bench_gpu.device=cpu",
                      "+bench_gpu.settings=[host_settings]", "+bench_gpu.trees=[chain4,eagle2]",
                      "+bench_gpu.profile_drafting=true", "+bench_gpu.profile_repeats=2")
    _, record = run_bench(cfg)
    for family in record["shapes"]["tiny"]["settings"]["host_settings"]["drafting"].values():
        for tree in ("chain4", "eagle2"):
            prof = family[tree]["profile"]
            assert prof["repeats"] == 2 and prof["wall_ms"] > 0 and prof["host_ops"] > 0
            assert prof["top_host_ops"] and all(k.startswith("aten::") for k in prof["top_host_ops"])
            assert prof["device_busy_ms"] is None and prof["kernels"] is None     # a CPU: no device kernels


def test_the_prepared_device_call_names_only_what_exists():
    """pipelines/bench/gpu_session.sh runs once in a short lease: every test file it names exists, and every bench
    setting it passes is one bench-gpu knows (a typo would spend the lease on an error)."""
    import re

    from pipelines.bench.gpu import DEFAULTS, SETTINGS, SHAPES
    from pipelines.common import REPO_ROOT

    script = (REPO_ROOT / "pipelines" / "bench" / "gpu_session.sh").read_text()
    files = re.findall(r"tests/\S+\.py", script)
    assert files and all((REPO_ROOT / f).is_file() for f in files)
    given = dict(re.findall(r"\+bench_gpu\.(\w+)=([^\"\s]+)", script))
    assert given and set(given) <= set(DEFAULTS)
    as_list = lambda v: v.strip("[]").split(",")      # noqa: E731
    assert set(as_list(given["settings"])) <= set(SETTINGS) and set(as_list(given["shapes"])) <= set(SHAPES)
