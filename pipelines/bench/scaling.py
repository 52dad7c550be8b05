"""python -m pipelines.bench.scaling [+scaling.heads=[hydra_pp,eagle3]] [+scaling.samples=[312,624]]
                                   [+scaling.root=/tmp/scaling] [+scaling.run=true]

A benchmark, not a stage: how each family's draft quality grows with its training data. Each family of
`heads` is trained (pipelines.train) on the first N train conversations for each N of `samples` (the val set and
every other setting as the profile has them), then calibrated (pipelines.calibrate), into <root>/n<N>/ (its own
results, reports and MLflow store; the pipeline's outputs are not touched). The full-data point is the pipeline's
own train@<heads> and calibrate@<heads>. With run=false (default) it only collects what is already there.

Reported per family and data size: the train targets seen (head-0 positions), val top-1 by depth, and the
replayed accepted tokens a step on the greedy tree of each node budget (the calibration's held-out greedy
continuations); then, for every other family against the first one, the ratio of replayed accepted lengths at
each budget, its least-squares slope per doubling of the train targets, and how many more doublings of the data
that pace would take from the largest size to `target`. Writes reports/bench/data_scaling.json
and reports/bench/data_scaling.png.

Caveat the record repeats: the train set lists the self-distilled conversations first and the relabelled
ShareGPT ones after them, so the first N (N <= the self-distilled count) hold no relabelled rows where the full
set does.
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from analysis.plots import plot_data_scaling
from pipelines.common import REPO_ROOT, log, stage, write_json

DEFAULTS = {"heads": ["hydra_pp", "eagle3"], "samples": [312, 624], "root": "/tmp/scaling", "run": False,
            "target": 1.25}   # the ratio to the first family whose distance, in doublings of data, is reported


def settings_of(cfg: DictConfig) -> dict:
    s = {**DEFAULTS, **OmegaConf.to_container(OmegaConf.select(cfg, "scaling", default=OmegaConf.create({})))}
    bad = [n for n in s["samples"] if not isinstance(n, int) or n < 1]
    if bad or not s["heads"]:
        raise ValueError(f"scaling.samples={s['samples']} (positive integers) and scaling.heads={s['heads']} "
                         "(at least one heads config) are required")
    return s


def folders(root: str, n: int) -> dict[str, Path]:
    base = Path(root) / f"n{n}"
    return {"results": base / "results", "reports": base / "reports", "mlflow": base / "mlflow.db"}


def run_one(cfg: DictConfig, heads: str, n: int, root: str) -> None:
    """Train then calibrate `heads` on the first n conversations, skipping what a previous run finished."""
    f = folders(root, n)
    overrides = [f"heads={heads}", f"profile.train.max_train_samples={n}", f"paths.results={f['results']}",
                 f"paths.reports={f['reports']}", f"mlflow.tracking_uri=sqlite:///{f['mlflow']}"]
    # the calibration's greedy continuations and the latency profile depend on the base model alone: reuse them
    main = Path(cfg.paths.results)
    for rel in ("cache/calibrate", "calibrate/latency.json"):
        src, dst = main / rel, f["results"] / rel
        if src.exists() and not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)
    steps = [("train", f["reports"] / "metrics" / f"train_{heads}.json"),
             ("calibrate", f["results"] / "calibrate" / heads / "calibration.json")]
    for name, done in steps:
        if done.is_file():
            log.info("%s n=%d %s: %s exists, skipped", heads, n, name, done)
            continue
        log.info("%s n=%d: %s", heads, n, name)
        subprocess.run([sys.executable, "-m", f"pipelines.{name}", *overrides], cwd=REPO_ROOT, check=True)


def point(train_json: Path, calibration_json: Path) -> dict | None:
    if not (train_json.is_file() and calibration_json.is_file()):
        return None
    t, c = json.loads(train_json.read_text()), json.loads(calibration_json.read_text())
    return {"train_examples": t["train_examples"], "train_targets_head0": t["train_targets_head0"],
            "epochs": t["epochs"], "val_top1": t["val_top1"],
            "replay_accept_length": {str(b["budget"]): round(b["replay_accept_length"], 4) for b in c["budgets"]},
            "train_wall_time_s": t.get("wall_time_s")}


def slope_per_doubling(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys against log2(xs): the change per doubling."""
    if len(xs) < 2:
        return None
    lx = [math.log2(x) for x in xs]
    mx, my = sum(lx) / len(lx), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in lx)
    return round(sum((x - mx) * (y - my) for x, y in zip(lx, ys)) / den, 4) if den else None


def slopes(rows: dict) -> dict:
    """{budget: slope per doubling of train targets} over rows {key: {train_targets_head0, by_budget}}."""
    budgets = sorted({b for r in rows.values() for b in r["by_budget"]}, key=int)
    xs = [r["train_targets_head0"] for r in rows.values()]
    return {b: slope_per_doubling(xs, [r["by_budget"][b] for r in rows.values()]) for b in budgets}


def collect(cfg: DictConfig, s: dict) -> dict:
    sources = {**{str(n): folders(s["root"], n) for n in s["samples"]},                 # the probe's runs
               "all": {"results": Path(cfg.paths.results), "reports": Path(cfg.paths.reports)}}   # the pipeline's
    families = {}
    for heads in s["heads"]:
        pts = {key: point(f["reports"] / "metrics" / f"train_{heads}.json",
                          f["results"] / "calibrate" / heads / "calibration.json") for key, f in sources.items()}
        families[heads] = dict(sorted(((k, p) for k, p in pts.items() if p),
                                      key=lambda kv: kv[1]["train_targets_head0"]))
    ref, ratios = s["heads"][0], {}
    for other in s["heads"][1:]:
        rows = {}
        for key in [k for k in families[other] if k in families[ref]]:
            a, b = families[other][key]["replay_accept_length"], families[ref][key]["replay_accept_length"]
            rows[key] = {"train_targets_head0": families[ref][key]["train_targets_head0"],
                         "by_budget": {bud: round(a[bud] / b[bud], 4) for bud in b if bud in a}}
        slope = slopes(rows)
        last = rows[max(rows, key=lambda k: rows[k]["train_targets_head0"])]["by_budget"] if rows else {}
        ratios[f"{other}_over_{ref}"] = {
            "by_data": rows, "slope_per_doubling": slope,
            # at the fitted pace, from the largest data size: None where the ratio does not grow
            f"doublings_to_{s['target']}": {b: round(max(0.0, (s["target"] - last[b]) / slope[b]), 1)
                                            if slope[b] and slope[b] > 0 else None for b in slope}}
    summary = {heads: {"points": pts, "slope_per_doubling": slopes(
        {k: {"train_targets_head0": p["train_targets_head0"], "by_budget": p["replay_accept_length"]}
         for k, p in pts.items()})} for heads, pts in families.items()}
    return {"what": "replayed accepted tokens a step (greedy tree per node budget, calibration continuations) and "
                    "val top-1 by depth, each family trained on the first N train conversations and on all of them",
            "caveat": "the train set lists self-distilled conversations first and relabelled ShareGPT ones last: "
                      "subsets of the first N hold only self-distilled rows",
            "command": "python -m pipelines.bench.scaling +scaling.run=true " + " ".join(
                f"+scaling.{k}={json.dumps(v).replace(' ', '')}" for k, v in s.items() if k != "run"),
            "families": summary, "ratios": ratios}


@stage
def main(cfg: DictConfig) -> None:
    s = settings_of(cfg)
    if s["run"]:
        for n in s["samples"]:
            for heads in s["heads"]:
                run_one(cfg, heads, n, s["root"])
    record = collect(cfg, s)
    out = Path(cfg.paths.reports) / "bench"
    path = write_json(out / "data_scaling.json", record)
    plot_data_scaling(record, out / "data_scaling.png")
    for name, r in record["ratios"].items():
        for key, row in r["by_data"].items():
            print(f"{name}, {key} ({row['train_targets_head0']} targets): "
                  + ", ".join(f"{b} nodes {v:.3f}x" for b, v in row["by_budget"].items()))
        key = f"doublings_to_{s['target']}"
        print(f"{name}: slope per doubling of data {r['slope_per_doubling']}; {key} {r[key]}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
