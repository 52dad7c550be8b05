"""python -m pipelines.export heads=medusa1 export.format=vllm

Trained heads in another tool's format, or another tool's heads in ours (models/shared/formats.py):

  heads=X export.format=medusa|vllm|hydra|eagle|eagle3|speculators
                                                 results/heads/X -> results/export/X-<format>/ (or export.dir=...)
  export.format=F export.import_from=FOLDER      FOLDER in format F -> a heads folder of ours: heads_dir=... or
                                                 results/heads/imported-F; then e.g.
                                                 python -m pipelines.generate heads_dir=results/heads/imported-F ...

Each export prints what the format holds differently (its notes); heads a format has no fields for are refused
with the reason. The base model is the configured one (model=...): imported heads must match its sizes.
"""
from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from models.shared import ADAPTER_DIR
from models.methods import export_heads, import_heads, known_formats, load_heads
from pipelines.common import load_model, log, stage


def export_folder(cfg: DictConfig) -> Path:
    return Path(cfg.export.dir or Path(cfg.paths.results) / "export" / f"{cfg.heads.name}-{cfg.export.format}")


def run_export(cfg: DictConfig) -> dict:
    fmt = cfg.export.format
    if fmt not in known_formats():
        raise ValueError(f"export.format={fmt!r}: accepted {', '.join(known_formats())}")
    model, _ = load_model(cfg)
    if cfg.export.import_from:
        heads = import_heads(cfg.export.import_from, model, fmt)
        out = Path(cfg.heads_dir or Path(cfg.paths.results) / "heads" / f"imported-{fmt}")
        heads.save(out)
        report = {"imported": str(cfg.export.import_from), "format": fmt, "heads_dir": str(out),
                  "family": heads.config.family, "num_heads": heads.config.num_heads}
    else:
        folder = Path(cfg.heads_dir or Path(cfg.paths.results) / "heads" / cfg.heads.name)
        if not folder.is_dir():
            raise FileNotFoundError(f"no trained heads in {folder}: train them with `python -m pipelines.train "
                                    f"heads={cfg.heads.name}` or point heads_dir=... at a heads folder")
        model, heads = load_heads(folder, model)
        report = export_heads(heads, model, export_folder(cfg), fmt, has_adapter=(folder / ADAPTER_DIR).is_dir())
    for note in report.get("notes", []):
        log.warning("export.format=%s: %s", fmt, note)
    print(json.dumps(report, indent=2))
    return report


@stage
def main(cfg: DictConfig) -> None:
    run_export(cfg)


if __name__ == "__main__":
    main()
