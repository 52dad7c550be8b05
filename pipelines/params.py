"""python -m pipelines.params [group=option ...]

Compose conf/ (with overrides) into params.yaml, the file every DVC stage reads. `dvc exp run -S`
does the same composition itself (DVC's Hydra integration, `.dvc/config`); `make repro` runs this
first so a plain `dvc repro` sees the current conf/. The file is rewritten only when it changes,
so an unchanged pipeline stays up to date.
"""
from __future__ import annotations

import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pipelines.common import CONF_DIR, REPO_ROOT


def compose_params(overrides: list[str]) -> str:
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    OmegaConf.resolve(cfg)
    return OmegaConf.to_yaml(cfg)


def main(argv: list[str]) -> None:
    text = compose_params(argv)
    path = REPO_ROOT / "params.yaml"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
        print(f"params.yaml written ({len(argv)} overrides)")


if __name__ == "__main__":
    main(sys.argv[1:])
