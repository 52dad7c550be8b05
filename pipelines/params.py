"""python -m pipelines.params [group=option ...]

Compose conf/ (with overrides) into params.yaml, the file every DVC stage reads. `dvc exp run -S`
does the same composition itself (DVC's Hydra integration, `.dvc/config`); `make repro` runs this
first so a plain `dvc repro` sees the current conf/. The file is rewritten only when it changes,
so an unchanged pipeline stays up to date. Overrides are recorded in its first line (a YAML comment, which DVC
ignores), so a committed params.yaml says how it was composed and can be checked against conf/.
"""
from __future__ import annotations

import json
import sys

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pipelines.common import CONF_DIR, REPO_ROOT


def compose_config(overrides: list[str]):
    """conf/ composed with the overrides and resolved, as `make repro` writes it into params.yaml."""
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    OmegaConf.resolve(cfg)
    return cfg


def compose_params(overrides: list[str]) -> str:
    return OmegaConf.to_yaml(compose_config(overrides))


OVERRIDES_LINE = "# composed from conf/ with overrides: "


def params_text(overrides: list[str]) -> str:
    """params.yaml's text: the composition, after a first line naming the overrides when there are any."""
    text = compose_params(overrides)
    return f"{OVERRIDES_LINE}{json.dumps(overrides)}\n{text}" if overrides else text


def recorded_overrides(text: str) -> list[str]:
    """The overrides a params.yaml text was composed with (its first line), [] when it names none."""
    first = text.split("\n", 1)[0]
    return json.loads(first[len(OVERRIDES_LINE):]) if first.startswith(OVERRIDES_LINE) else []


def main(argv: list[str]) -> None:
    text = params_text(argv)
    path = REPO_ROOT / "params.yaml"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
        print(f"params.yaml written ({len(argv)} overrides)")


if __name__ == "__main__":
    main(sys.argv[1:])
