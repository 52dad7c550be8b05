"""Every option of every config group composes; unknown options fail with Hydra's list; params.yaml is current."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import MissingConfigException
from omegaconf import OmegaConf

from pipelines.params import compose_params, params_text, recorded_overrides

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF = REPO_ROOT / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]


def compose_with(*overrides: str):
    with initialize_config_dir(str(CONF), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def test_the_groups_the_pipeline_needs_are_there():
    assert {"model", "heads", "tree", "data", "profile", "trainer", "eval"} <= set(GROUPS)
    for group, option in [("model", "smollm2_135m"), ("model", "tiny_random"), ("profile", "cpu"),
                          ("profile", "smoke"), ("profile", "paper"), ("tree", "sparse64")]:
        assert (group, option) in OPTIONS


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_resolves(group, option):
    cfg = compose_with(f"{group}={option}")
    resolved = OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    assert isinstance(resolved[group], dict) and resolved[group]
    assert isinstance(resolved[group].get("name", ""), str)


@pytest.mark.parametrize("group", GROUPS)
def test_unknown_option_lists_the_available_ones(group):
    with pytest.raises(MissingConfigException) as err:
        compose_with(f"{group}=no_such_option")
    message = str(err.value)
    assert "Available options" in message
    for g, option in OPTIONS:
        if g == group:
            assert option in message


def test_unknown_option_on_a_stage_command_line():
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    out = subprocess.run([sys.executable, "-m", "pipelines.prepare", "model=no_such_model"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode != 0
    assert "Could not find 'model/no_such_model'" in out.stderr and "smollm2_135m" in out.stderr


def test_params_yaml_is_the_default_composition(monkeypatch):
    """The committed params.yaml is conf/ composed with no overrides: the default pipeline, not an experiment."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    text = (REPO_ROOT / "params.yaml").read_text()
    assert recorded_overrides(text) == [], "params.yaml records overrides: run `python -m pipelines.params` before committing"
    assert text == params_text([]), "params.yaml is stale: run `python -m pipelines.params` after changing conf/"


def test_params_record_their_overrides(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    text = params_text(["profile.eval.num_questions=16", "seed=7"])
    assert recorded_overrides(text) == ["profile.eval.num_questions=16", "seed=7"]
    body = yaml.safe_load(text)                       # the record is a comment: the params are unchanged
    assert body["seed"] == 7 and body["profile"]["eval"]["num_questions"] == 16
    assert text.split("\n", 1)[1] == compose_params(["profile.eval.num_questions=16", "seed=7"])
    assert params_text([]) == compose_params([]) and recorded_overrides(compose_params([])) == []


def test_profile_prepare_keys():
    for profile in ("smoke", "cpu", "paper"):
        prepare = compose_with(f"profile={profile}").profile.prepare
        assert prepare.max_length > 0
        assert prepare.max_conversations is None or prepare.max_conversations > 0


def dvc_stages(tmp_path, overrides: list[str]) -> dict[str, list[str]]:
    """What `dvc exp run -S <overrides>` would see: DVC's own Hydra composition into params.yaml, then
    dvc.yaml's stages resolved against it ({stage name: its outputs})."""
    from dvc.repo import Repo
    from dvc.utils.hydra import compose_and_dump

    tmp_path.mkdir()
    shutil.copy(REPO_ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    compose_and_dump(tmp_path / "params.yaml", str(CONF), None, "config", str(tmp_path), overrides)
    repo = Repo.init(str(tmp_path), no_scm=True)
    try:
        return {s.name: sorted(str(o.def_path) for o in s.outs) for s in repo.index.stages}
    finally:
        repo.close()


def test_dvc_runs_one_chain_per_family_beside_the_references(tmp_path, monkeypatch):
    """train@h -> calibrate@h -> evaluate@h for every family of pipeline_heads, each writing its own outputs; one
    references stage; a profile that evaluates fewer families (profile=smoke) has fewer evaluate stages."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    default = dvc_stages(tmp_path / "default", [])
    heads = list(compose_with().pipeline_heads)
    for h in heads:
        assert default[f"train@{h}"] == [f"reports/metrics/train_{h}.json", f"results/heads/{h}"]
        assert default[f"calibrate@{h}"] == [f"reports/metrics/calibrate_{h}.json", f"results/calibrate/{h}"]
        assert default[f"evaluate@{h}"] == [f"reports/metrics/evaluate_{h}.json", f"results/eval/{h}"]
    assert default["references"] == ["reports/metrics/references.json", "results/eval/references"]
    assert set(default) == {"assets", "prepare", "distill", "calibrate_latency", "references", "batch_baseline",
                            "tables", *[f"{s}@{h}" for s in ("train", "calibrate", "evaluate", "batch") for h in heads]}
    for h in heads:                                       # the batch curve: one stage per evaluated family
        assert default[f"batch@{h}"] == [f"reports/metrics/batch_{h}.json", f"results/batch/{h}"]

    smoke = dvc_stages(tmp_path / "smoke", ["profile=smoke"])
    families = list(compose_with("profile=smoke").profile.eval.families)
    assert sorted(n for n in smoke if n.startswith("evaluate@")) == sorted(f"evaluate@{h}" for h in families)
    assert sorted(n for n in smoke if n.startswith("batch@")) == sorted(f"batch@{h}" for h in families)
