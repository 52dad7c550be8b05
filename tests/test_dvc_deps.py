"""dvc.yaml's code deps cover what each stage runs (its import closure), and name no model."""
from __future__ import annotations

import yaml

from pipelines.common import REPO_ROOT
from pipelines.deps import import_closure, missing_deps


def test_every_stage_depends_on_the_code_it_imports():
    assert missing_deps() == {}


def test_a_dropped_dependency_is_reported(tmp_path):
    dvc = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())
    dvc["stages"]["evaluate"]["deps"].remove("models/engine/acceptance.py")
    dvc["stages"]["train"]["do"]["deps"].remove("models/heads/families.py")
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(dvc))
    assert missing_deps(tmp_path / "dvc.yaml") == {"evaluate": ["models/engine/acceptance.py"],
                                                  "train": ["models/heads/families.py"]}


def test_a_folder_dependency_covers_its_files(tmp_path):
    dvc = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())
    deps = dvc["stages"]["tables"]["deps"]
    dvc["stages"]["tables"]["deps"] = [d for d in deps if not d.startswith("analysis/")] + ["analysis"]
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(dvc))
    assert "tables" not in missing_deps(tmp_path / "dvc.yaml")


def test_the_closure_follows_imports_inside_functions_and_packages():
    closure = import_closure("pipelines.evaluate")
    # models.engine.decoding imports models.engine.acceptance at the top and the heads' drafter lazily or not:
    for f in ("pipelines/evaluate.py", "pipelines/common.py", "models/base.py", "models/engine/__init__.py",
              "models/engine/decoding.py", "models/engine/acceptance.py", "models/heads/families.py"):
        assert f in closure, f
    assert not any(f.startswith(("tests/", ".venv")) for f in closure)
    assert "models/base.py" in import_closure("pipelines.assets")        # pipelines.common loads the model lazily


def test_dvc_yaml_names_no_model():
    text = (REPO_ROOT / "dvc.yaml").read_text()
    assert "SmolLM2" not in text and "artifacts/models" not in text and "${model.files}" in text
