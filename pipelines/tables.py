"""python -m pipelines.tables

The papers' tables with ours beside the published numbers (docs/reference.md#published-numbers), from the
evaluate runs of the chains, results/eval/references/ and results/eval/<heads>/ for each family of
profile.eval.families, merged into one summary (analysis/merge.py: every speedup over its own run's baseline,
methods of different runs paired by question), and results/calibrate/*/calibration.json when present.
Writes to reports/:

  tables.md, tables.tex            Medusa table, Hydra table, EAGLE and draft-model table, speedups
                                   (end to end, decode-only, against the stronger prompt lookup), per category,
                                   tree choice, calibration
  speedup_per_category.png         bars per category for the methods on eval.plot_tree (+ both PLDs)
  accept_length_histogram.png      tokens emitted per step, per method on eval.plot_tree (+ both PLDs)
  speedup_vs_tree_size.png         speedup (end to end and decode-only) against tree nodes, per heads; PLDs as lines
  calibration.png                  predicted (calibrate) vs measured (evaluate) accepted length
  speedup.csv                      one row per method: the data behind `dvc plots show`
  results.md                       the results document: the run (from the reports/metrics/*.json of this run's
                                   stages alone: those dvc.yaml defines for this config, less any a run of another
                                   profile left, and artifacts/assets.json's record of the base weights), headline
                                   figures with 95% intervals, paired comparisons, the papers' claims judged by them,
                                   per-category means, Medusa-2's joint stage (also reads reports/conformance.json,
                                   results/calibrate/latency.json), and a projection of the papers' acceptance
                                   over the step costs in the GPU bench file eval.gpu_bench
  speedup_intervals.png            every method's speedup with its interval
  comparisons.png                  the paired comparisons, ratio and interval
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf

from analysis import plots
from analysis.batch_curve import batch_markdown, batch_rows, load_batch_runs, plot_batch_curve
from analysis.comparisons import standard_comparisons
from analysis.cost_model import RATES_FILE, Plan, project, settings_from_metrics, stage_work
from analysis.merge import merged_summary
from analysis.projection import projection_markdown
from analysis.results import results_markdown
from analysis.calibration_tables import calibration_rows
from analysis.render import build_tables, to_latex, to_markdown
from analysis.run_record import this_run
from analysis.tables import load_calibrations
from pipelines.common import REPO_ROOT, log, mlflow_run, stage

TABLE_ORDER = ("medusa", "hydra", "eagle", "speed", "category", "tree_choice", "calibration")


def settings_line(summary: dict) -> str:
    s = summary.get("settings", {})
    keys = ("num_questions", "turns", "max_new_tokens", "repeats", "temperature_mode", "profile")
    parts = [f"{k}={s.get(k, summary.get(k))}" for k in keys if s.get(k, summary.get(k)) is not None]
    return f"Ours: {summary['model']} on {summary['hardware']}; " + ", ".join(parts) + "."


def write_csv(summary: dict, path: Path) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "heads", "tree", "tree_nodes", "speedup", "speedup_ci_low", "speedup_ci_high",
                    "decode_speedup", "accept_length", "accept_length_ci_low", "accept_length_ci_high", "throughput",
                    "questions"])
        for name, m in summary["methods"].items():
            if m["kind"] == "reference":
                continue
            decode = m.get("decode_speedup") or {}
            iv = m.get("intervals") or {}
            sp, acc = (iv.get("speedup") or {}).get("ci") or [None, None], (iv.get("accept_length") or {}).get("ci") or [None, None]
            w.writerow([name, m.get("heads") or "", m.get("tree") or "", m.get("tree_nodes") or 0,
                        _r(m["speedup"]["mean"]), _r(sp[0]), _r(sp[1]), _r(decode.get("mean")),
                        _r(m["accept_length"]["mean"]), _r(acc[0]), _r(acc[1]), _r(m["throughput"]["mean"]),
                        m.get("questions") or ""])
    return path


def _r(x):
    return "" if x is None else round(float(x), 4)


def load_stage_metrics(folder: Path, stages=None, profile: str | None = None) -> dict[str, dict]:
    """{stem: reports/metrics/<stem>.json} for prepare, distill, every train, calibrate and evaluate stage, the
    references and the batch curve's stages (dvc.yaml lists them). With stages (run_metric_stems), those of this run
    alone, less any whose run record names a profile other than `profile` (analysis/run_record.py this_run); the
    files left out are logged."""
    paths = [folder / "prepare.json", folder / "distill.json", *sorted(folder.glob("train_*.json")),
             *sorted(folder.glob("calibrate_*.json")), folder / "references.json", *sorted(folder.glob("evaluate_*.json")),
             *sorted(folder.glob("batch_*.json"))]
    metrics = {p.stem: json.loads(p.read_text()) for p in paths if p.is_file()}
    if stages is None:
        return metrics
    kept, left_out = this_run(metrics, stages, profile)
    if left_out:
        log.info("the run section leaves out %s",
                 "; ".join(f"{folder / n}.json ({why})" for n, why in left_out.items()))
    return kept


def run_metric_stems(cfg: DictConfig, dvc_file: Path = REPO_ROOT / "dvc.yaml") -> list[str]:
    """The stems of the reports/metrics/<stem>.json files the stages of dvc.yaml write for this config: each stage's
    metrics, a foreach stage's once for each item of the list it runs over (pipeline_heads, profile.eval.families)."""
    stems = []
    for st in (yaml.safe_load(dvc_file.read_text()).get("stages") or {}).values():
        items, body = [None], st
        if "foreach" in st:
            each = st["foreach"]
            if isinstance(each, str) and each.startswith("${") and each.endswith("}"):
                key, each = each[2:-1], OmegaConf.select(cfg, each[2:-1])
                if each is None:
                    raise ValueError(f"{dvc_file}: a stage runs over ${{{key}}}, which the config does not set")
                each = OmegaConf.to_container(each) if OmegaConf.is_config(each) else each
            items, body = list(each), st.get("do") or {}
        for entry in body.get("metrics") or []:
            path = next(iter(entry)) if isinstance(entry, dict) else str(entry)
            for item in items:
                p = Path(path if item is None else path.replace("${item}", str(item)))
                if p.parent.as_posix() == "reports/metrics":
                    stems.append(p.stem)
    return stems


def load_json_if_present(path: Path) -> dict | None:
    """A JSON file's contents, or None when it is not there (the latency profile, the conformance report)."""
    return json.loads(path.read_text()) if path.is_file() else None


def make_reports(cfg: DictConfig) -> list[Path]:
    """Write tables.md, tables.tex, the PNGs and speedup.csv to cfg.paths.reports; return their paths."""
    results, reports = Path(cfg.paths.results), Path(cfg.paths.reports)
    summary = merged_summary(results / "eval", list(cfg.profile.eval.families))
    calibrations = load_calibrations(results / "calibrate")
    tables = build_tables(summary, calibrations)
    header = (f"<!-- written by `python -m pipelines.tables` from results/eval/{{{','.join(summary['runs'])}}}/summary.json"
              f" -->\n{settings_line(summary)}\n\n")
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
             write_csv(summary, reports / "speedup.csv"),
             plots.plot_speedup_intervals(summary, reports / "speedup_intervals.png"),
             plots.plot_comparisons(standard_comparisons(summary), reports / "comparisons.png")]
    batch_rows_ = batch_rows(summary, load_batch_runs(results / "batch"))      # the batch curve, where it ran
    batch_md = batch_markdown(batch_rows_)
    (reports / "batch_curve.md").write_text("<!-- written by `python -m pipelines.tables` from results/batch/ -->\n"
                                            + (batch_md or "No batch size above 1 was run (profile.eval.batch_sizes).\n"))
    paths += [reports / "batch_curve.md", plot_batch_curve(batch_rows_, reports / "batch_curve.png")]
    run = load_stage_metrics(reports / "metrics", run_metric_stems(cfg), cfg.profile.get("name"))   # this run's stages
    train = {n[len("train_"):]: m for n, m in run.items() if n.startswith("train_")}
    assets = load_json_if_present(Path(cfg.paths.artifacts) / "assets.json")
    if run and assets:
        run["assets"] = assets                   # the base weights' source, for the run section's first line
    latency = load_json_if_present(results / "calibrate" / "latency.json")
    (reports / "results.md").write_text(results_markdown(summary, train, latency,
                                                         run=run, projected=cost_projection(cfg, latency, run),
                                                         conformance=load_json_if_present(reports / "conformance.json"),
                                                         projection=projection_markdown(cfg.eval.gpu_bench, REPO_ROOT),
                                                         batch=batch_rows_))
    paths.append(reports / "results.md")
    log.info("tables: %s", ", ".join(t for t in TABLE_ORDER if t in tables))
    print(md)
    return paths




def cost_projection(cfg: DictConfig, latency: dict | None, run: dict[str, dict]) -> dict[str, float] | None:
    """{stage: seconds} the cost model projects for this config at the run's own plain step and weight read
    (analysis/cost_rates.json's rates, those of the run before), to stand beside the measured times; the families'
    epochs and extra answers as this run's metrics record them."""
    step, floor = (latency or {}).get("baseline_step_s"), ((latency or {}).get("weight_read") or {}).get("seconds")
    if not step or not floor or not RATES_FILE.is_file():
        return None
    rates = json.loads(RATES_FILE.read_text())["rates"]
    plan = Plan.from_params(OmegaConf.to_container(cfg, resolve=True), *settings_from_metrics(run))
    return {r.stage: r.seconds for r in project(stage_work(plan), rates, step, floor) if r.seconds}


@stage
def main(cfg: DictConfig) -> None:
    with mlflow_run(cfg, "tables"):
        import mlflow

        for path in make_reports(cfg):
            mlflow.log_artifact(str(path))


if __name__ == "__main__":
    main()
