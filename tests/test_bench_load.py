"""pytest tests/test_bench_load.py: the load benchmark's settings and arithmetic (pipelines/bench/load.py) and the
OpenMP policy the decoding commands start with (pipelines/omp.py). No timings are asserted."""
from __future__ import annotations

import os

import pytest

from pipelines import omp
from pipelines.common import REPO_ROOT
from pipelines.bench.load import competing, parse_setting, run_in_process, setting_environ, slowdown, summarize


def run(tps: float, ms: float, cut: bool = False) -> dict:
    return {"tokens_per_second": tps, "ms_per_step": ms, "prefill_ms": 100.0, "mean_accepted_length": 2.0,
            "cut_short": cut}


def test_slowdown_is_quiet_over_loaded_speed_of_the_medians():
    quiet = summarize([run(30.0, 60.0), run(40.0, 50.0), run(35.0, 55.0)])
    loaded = summarize([run(7.0, 300.0), run(5.0, 500.0, cut=True)])
    assert (quiet["tokens_per_second"], quiet["ms_per_step"]) == (35.0, 55.0)
    assert (loaded["tokens_per_second"], loaded["ms_per_step"], loaded["cut_short"]) == (6.0, 400.0, 1)
    s = slowdown(quiet, loaded)
    assert s["tokens_per_second"] == pytest.approx(35 / 6)
    assert s["ms_per_step"] == pytest.approx(400 / 55)


def test_a_setting_names_its_environment_and_threads():
    passive = parse_setting("passive@1")
    assert passive["threads"] == 1
    env = setting_environ(passive, {"GOMP_SPINCOUNT": "5", "OMP_WAIT_POLICY": "ACTIVE", "HOME": "/x"})
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", omp.SWITCH: "off", "HOME": "/x"}
    spin = setting_environ(parse_setting("spin1000", threads=2), {"OMP_WAIT_POLICY": "ACTIVE"})
    assert spin == {"GOMP_SPINCOUNT": "1000", omp.SWITCH: "off"}
    assert setting_environ(parse_setting("default"), {"OMP_WAIT_POLICY": "ACTIVE"}) == {omp.SWITCH: "off"}
    assert setting_environ(parse_setting("auto"), {"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_WAIT_POLICY": "ACTIVE"}
    assert parse_setting("auto", threads=2)["threads"] == 2
    for bad in ("sleepy", "spinfast", "passive@two"):
        with pytest.raises(ValueError):
            parse_setting(bad)


def test_decoding_commands_start_with_the_policy_unless_the_environment_says_otherwise():
    assert omp.omp_defaults({}, others=0.0) == {}                      # a quiet machine: libgomp's spin
    assert omp.omp_defaults({}, others=None) == {}                     # an OS that does not tell: the same
    assert omp.omp_defaults({}, others=1.0) == omp.OMP_POLICY          # others want the cores: sleep at once
    assert omp.omp_defaults({omp.SWITCH: "passive"}, others=0.0) == omp.OMP_POLICY
    assert omp.omp_defaults({omp.SWITCH: "off"}, others=2.0) == {}
    for var in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):                  # the user's own setting wins
        assert omp.omp_defaults({var: "1"}, others=2.0) == {}
    # the decoding commands import it before torch; the training and data stages do not import it at all
    for name in ("evaluate", "generate", "calibrate", "bench/verify", "bench/cut", "bench/load", "bench/gpu"):
        text = (REPO_ROOT / "pipelines" / f"{name}.py").read_text()
        assert "from pipelines import omp" in text and text.index("from pipelines import omp") < text.index("import torch") \
            if "import torch" in text else "from pipelines import omp" in text, name
    for name in ("train", "distill", "prepare"):
        assert "pipelines import omp" not in (REPO_ROOT / "pipelines" / f"{name}.py").read_text()


def test_competitors_run_until_the_block_ends():
    with competing([1], 16) as pids:
        assert len(pids) == 1
        os.kill(pids[0], 0)                                  # alive
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)                                  # stopped and reaped


def test_a_setting_runs_in_its_own_process_with_its_environment(tmp_path):
    overrides = ["model=tiny_random", f"paths.results={tmp_path / 'results'}", "+bench.methods=[none,medusa1/chain4]",
                 "+bench.competitors=[]", "+bench.new_tokens=3", "+bench.repeats=1", "+bench.prompt_tokens=40",
                 f"hydra.run.dir={tmp_path / 'hydra'}"]
    res = run_in_process(parse_setting("spin77@1"), overrides)
    assert res["threads"] == 1
    assert res["environment"]["GOMP_SPINCOUNT"] == "77" and res["environment"]["OMP_WAIT_POLICY"] is None
    assert [r["method"] for r in res["rows"]] == ["baseline", "medusa1/chain4"]
    assert res["rows"][1]["random_heads"] is True
    for r in res["rows"]:
        assert r["quiet"]["runs"][0]["tokens"] == 2           # 3 new tokens: the prefill's, then 2 from steps
        assert r["slowdown"]["tokens_per_second"] > 0


def test_the_machine_counts_as_busy_from_linux_runnable_threads(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3\nprocs_running 3\nprocs_blocked 0\n")
    assert omp.other_runnable(samples=3, interval=0.0, stat=str(stat)) == 2.0      # this process is one of the 3
    assert omp.other_runnable(stat=str(tmp_path / "none")) is None
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    chosen = omp.choose(env)                                           # the user's variable: nothing sampled or added
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"} and chosen["policy"] == "ACTIVE" and chosen["other_runnable"] is None
