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


def test_params_yaml_is_the_composition_of_conf(monkeypatch):
    """The committed params.yaml is conf/ composed with the overrides its first line records (none: conf/ alone)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    text = (REPO_ROOT / "params.yaml").read_text()
    overrides = recorded_overrides(text)
    assert text == params_text(overrides), (
        f"params.yaml is stale: run `python -m pipelines.params {' '.join(overrides)}` after changing conf/")


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


def test_dvc_exp_run_override_adds_its_own_evaluate_stage(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    default = dvc_stages(tmp_path / "default", [])
    assert "evaluate" in default and not any(name.startswith("evaluate_selected") for name in default)
    assert default["evaluate"] == ["reports/metrics/evaluate.json", "results/eval/all"]

    chosen = dvc_stages(tmp_path / "chosen", ["heads=hydra_pp", "tree=sparse64"])
    assert chosen["evaluate_selected@hydra_pp-sparse64"] == ["reports/metrics/evaluate_hydra_pp-sparse64.json",
                                                             "results/eval/hydra_pp-sparse64"]
    # every other stage keeps its outputs: the default results are not touched
    assert {k: v for k, v in chosen.items() if not k.startswith("evaluate_selected")} == default
