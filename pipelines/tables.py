"""python -m pipelines.tables [eval.table_tag=all]

The papers' tables with ours beside the published numbers (shared/REFERENCE.md section 5), from the
evaluate summary results/eval/<eval.table_tag>/summary.json (and results/calibrate/*/calibration.json
when present). Writes to reports/:

  tables.md, tables.tex            Medusa table, Hydra table, speedups (end to end, decode-only, against the
                                   stronger prompt lookup), per category, tree choice, calibration
  speedup_per_category.png         bars per category for the methods on eval.plot_tree (+ both PLDs)
  accept_length_histogram.png      tokens emitted per step, per method on eval.plot_tree (+ both PLDs)
  speedup_vs_tree_size.png         speedup (end to end and decode-only) against tree nodes, per heads; PLDs as lines
  calibration.png                  predicted (calibrate) vs measured (evaluate) accepted length
  speedup.csv                      one row per method: the data behind `dvc plots show`
"""
from __future__ import annotations

import csv
from pathlib import Path

from omegaconf import DictConfig

from analysis import plots
from analysis.tables import build_tables, calibration_rows, load_calibrations, load_summary, to_latex, to_markdown
from pipelines.common import log, mlflow_run, stage

TABLE_ORDER = ("medusa", "hydra", "speed", "category", "tree_choice", "calibration")


def settings_line(summary: dict) -> str:
    s = summary.get("settings", {})
    keys = ("num_questions", "turns", "max_new_tokens", "repeats", "temperature_mode", "profile")
    parts = [f"{k}={s.get(k, summary.get(k))}" for k in keys if s.get(k, summary.get(k)) is not None]
    return f"Ours: {summary['model']} on {summary['hardware']}; " + ", ".join(parts) + "."


def write_csv(summary: dict, path: Path) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "heads", "tree", "tree_nodes", "speedup", "speedup_std", "decode_speedup",
                    "decode_speedup_std", "accept_length", "throughput", "questions"])
        for name, m in summary["methods"].items():
            if m["kind"] == "reference":
                continue
            decode = m.get("decode_speedup") or {}
            w.writerow([name, m.get("heads") or "", m.get("tree") or "", m.get("tree_nodes") or 0,
                        _r(m["speedup"]["mean"]), _r(m["speedup"]["std"]), _r(decode.get("mean")),
                        _r(decode.get("std")), _r(m["accept_length"]["mean"]), _r(m["throughput"]["mean"]),
                        m.get("questions") or ""])
    return path


def _r(x):
    return "" if x is None else round(float(x), 4)


def make_reports(cfg: DictConfig) -> list[Path]:
    """Write tables.md, tables.tex, the PNGs and speedup.csv to cfg.paths.reports; return their paths."""
    results, reports = Path(cfg.paths.results), Path(cfg.paths.reports)
    summary = load_summary(results / "eval" / cfg.eval.table_tag / "summary.json")
    calibrations = load_calibrations(results / "calibrate")
    tables = build_tables(summary, calibrations)
    header = (f"<!-- written by `python -m pipelines.tables` from results/eval/{cfg.eval.table_tag}/summary.json -->\n"
              f"{settings_line(summary)}\n\n")
    md = header + "\n".join(to_markdown(tables[k]) for k in TABLE_ORDER if k in tables)
    tex = "% written by `python -m pipelines.tables`\n" + "\n".join(to_latex(tables[k]) for k in TABLE_ORDER if k in tables)
    reports.mkdir(parents=True, exist_ok=True)
    (reports / "tables.md").write_text(md)
    (reports / "tables.tex").write_text(tex)

    trees = {m.get("tree") for m in summary["methods"].values()}
    plot_tree = cfg.eval.plot_tree if cfg.eval.plot_tree in trees else None
    paths = [reports / "tables.md", reports / "tables.tex",
             plots.plot_speedup_per_category(summary, reports / "speedup_per_category.png", tree=plot_tree),
             plots.plot_accept_histogram(summary, reports / "accept_length_histogram.png", tree=plot_tree),
             plots.plot_speedup_vs_tree_size(summary, reports / "speedup_vs_tree_size.png"),
             plots.plot_calibration(calibration_rows(summary, calibrations), reports / "calibration.png"),
             write_csv(summary, reports / "speedup.csv")]
    log.info("tables: %s", ", ".join(t for t in TABLE_ORDER if t in tables))
    print(md)
    return paths


@stage
def main(cfg: DictConfig) -> None:
    with mlflow_run(cfg, "tables"):
        import mlflow

        for path in make_reports(cfg):
            mlflow.log_artifact(str(path))


if __name__ == "__main__":
    main()
