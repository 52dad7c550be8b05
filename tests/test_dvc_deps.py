"""dvc.yaml's code deps cover what each stage runs (its import closure) and no more, each family's chain reads only
its own family's files, and dvc.yaml names no model."""
from __future__ import annotations

import yaml

from pipelines.common import REPO_ROOT
from pipelines.deps import broad_deps, import_closure, missing_deps

CHAINS = ("train", "calibrate", "evaluate")      # the foreach stages of one family each


def test_every_stage_depends_on_the_code_it_imports_and_no_folder_of_code_it_does_not():
    assert missing_deps() == {}
    assert broad_deps() == {}


def test_a_dropped_dependency_is_reported(tmp_path):
    dvc = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())
    refs = dvc["stages"]["references"]
    refs["deps"] = [d for d in refs["deps"] if not str(d).startswith("models/engine")]
    dvc["stages"]["train"]["do"]["deps"].remove("models/engine/taps.py")
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(dvc))
    missing = missing_deps(tmp_path / "dvc.yaml")
    assert set(missing) == {"references", "train"} and missing["train"] == ["models/engine/taps.py"]
    assert {"models/engine/acceptance.py", "models/engine/drafters/tree.py"} <= set(missing["references"])
    assert all(f.startswith("models/engine/") for f in missing["references"])


def test_a_folder_dependency_covers_its_files_and_must_hold_only_code_the_stage_runs(tmp_path):
    dvc = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())
    deps = dvc["stages"]["tables"]["deps"]
    dvc["stages"]["tables"]["deps"] = [d for d in deps if not d.startswith("analysis/")] + ["analysis"]
    dvc["stages"]["evaluate"]["do"]["deps"].append("models/shared")     # its fitting and training data too
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(dvc))
    assert "tables" not in missing_deps(tmp_path / "dvc.yaml")
    broad = broad_deps(tmp_path / "dvc.yaml")
    assert broad["tables"] == ["analysis/readme.py"]                   # the README's table, not the stage's
    assert "models/shared/fitting.py" in broad["evaluate"] and "models/shared/draft_heads.py" not in broad["evaluate"]


def test_each_chain_reads_only_its_own_familys_files():
    """A stage of one family's chain names the trained, calibrated and config files of its item only (or what every
    family shares: the latency profile), so retraining one family reruns that chain and no other."""
    stages = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())["stages"]
    per_family = ("results/heads", "results/calibrate", "results/eval", "conf/heads", "reports/metrics")
    for name in CHAINS:
        body = stages[name]["do"]
        paths = [*body["deps"], *[next(iter(o)) if isinstance(o, dict) else o
                                  for key in ("outs", "metrics") for o in body.get(key, [])]]
        for path in paths:
            if path.startswith(per_family) and path != "results/calibrate/latency.json":
                assert "${item}" in path, f"stage {name} names {path}, not its own family's (${{item}})"


def test_the_closure_follows_imports_inside_functions_and_packages():
    closure = import_closure("pipelines.evaluate")
    # models.engine.decoding imports models.engine.acceptance at the top and the heads' drafter lazily or not:
    for f in ("pipelines/evaluate.py", "pipelines/common.py", "models/base.py", "models/engine/__init__.py",
              "models/engine/decoding.py", "models/engine/acceptance.py", "models/shared/families.py",
              "models/methods/hydra/prefix.py", "models/methods/medusa/proposer.py"):
        assert f in closure, f
    assert not any(f.startswith(("tests/", ".venv")) for f in closure)
    assert "models/base.py" in import_closure("pipelines.assets")        # pipelines.common loads the model lazily


def test_dvc_yaml_names_no_model():
    text = (REPO_ROOT / "dvc.yaml").read_text()
    assert "SmolLM2" not in text and "artifacts/models" not in text and "${model.files}" in text
