"""python -m pipelines.bench.baseline_noise   (make bench-baseline-noise)   [+baseline_noise.questions=40]

A benchmark, not a test: what sharing one baseline between stages would cost the paired intervals on this machine.
Each evaluate@<heads> stage now decodes the baseline beside its methods, question by question, so a question's
speedup divides two times taken seconds apart; the references stage decodes the same greedy baseline too. Sharing
the references' baseline would spare every evaluate stage its own (80 answers a stage), but a question's speedup
would then divide times taken in different processes, minutes or hours apart: the machine's drift between them
enters every ratio.

This runs the references stage (the baseline and prompt lookup on every question, profile.eval's protocol) twice,
in two processes one after the other as two stages run, each into its own results folder, and compares prompt
lookup's speedup interval in the second run with its own baseline (today's design) against the same answers over
the first run's baseline (the shared design), and the reverse; and how far the two runs' baselines drift, question
by question. Writes reports/bench/baseline_noise.json; keep the machine quiet while it runs.

It also reads the lever between the two designs, a shared baseline corrected per stage: a stage decodes its own
baseline on baseline_noise.correction_questions of the questions (spread over the categories), and divides the
other run's baseline times by the drift those questions show (the geometric mean of its own baseline's
throughput over the other's) for every question. What it reports: that corrected speedup beside the own and the
shared ones, and the correction's residual on the questions it was not measured on.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipelines import omp  # noqa: F401  (first: sets OpenMP's wait policy before torch loads)
from models.hardware import host_record
from models.measure.benchmark import speed_intervals
from models.measure.mtbench import spread
from pipelines.common import REPO_ROOT, log, stage, write_json

DEFAULTS = {"questions": None, "method": "pld", "out": "reports/bench/baseline_noise.json", "correction_questions": 16}


def run_references(folder: Path, questions) -> float:
    """The references stage into folder/results (a process of its own, as dvc runs a stage) -> its seconds."""
    t0 = time.perf_counter()
    extra = [] if questions is None else [f"profile.eval.num_questions={int(questions)}"]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{folder / 'mlflow.db'}"}     # not the project's store
    subprocess.run([sys.executable, "-m", "pipelines.evaluate", "eval.methods=references",
                    f"paths.results={folder / 'results'}", f"paths.reports={folder / 'reports'}",
                    f"paths.data={folder / 'data'}", *extra],
                   check=True, cwd=REPO_ROOT, env=env)
    return time.perf_counter() - t0


def per_question(folder: Path, method: str) -> dict[str, dict]:
    summary = json.loads((folder / "results" / "eval" / "references" / "summary.json").read_text())
    return summary["methods"][method]["per_question"]


def over_baseline(rows: dict[str, dict], base: dict[str, dict]) -> dict[str, dict]:
    """rows with their baseline's tokens and times taken from `base` (another run's rows of the same questions)."""
    keys = ("base_tokens", "base_time", "base_decode_tokens", "base_decode_time")
    out = {}
    for q, r in rows.items():
        b = {k: base[q][k] for k in keys}
        speedup = (r["tokens"] / r["time"]) / (b["base_tokens"] / b["base_time"])
        out[q] = {**r, **b, "speedup": speedup, "decode_speedup": None}
    return out


def width(intervals: dict) -> float:
    lo, hi = intervals["speedup"]["ci"]
    return hi - lo


def compare(a: dict[str, dict], b: dict[str, dict]) -> dict:
    """Run b's method over its own baseline and over run a's: the speedups and the intervals' widths."""
    own, shared = speed_intervals(b), speed_intervals(over_baseline(b, a))
    return {"own_baseline": own["speedup"], "shared_baseline": shared["speedup"],
            "width_own": width(own), "width_shared": width(shared), "width_ratio": width(shared) / width(own)}


def throughput(r: dict) -> float:
    return r["base_tokens"] / r["base_time"]


def corrected(a: dict[str, dict], b: dict[str, dict], n: int) -> dict:
    """Run b's method over run a's baseline, each of a's baseline times scaled by the drift that n of the questions
    (spread over them, sorted by id: over the categories) show between b's own baseline and a's. The speedup and
    its interval, and the correction's residual (b's own baseline over a's corrected one) on the other questions."""
    qs = sorted((q for q in b if q in a), key=int)
    measured = spread(qs, n)
    factor = math.exp(statistics.fmean(math.log(throughput(b[q]) / throughput(a[q])) for q in measured))
    scaled = {q: {**a[q], "base_time": a[q]["base_time"] / factor, "base_decode_time": a[q]["base_decode_time"] / factor}
              for q in qs}
    c, own = speed_intervals(over_baseline({q: b[q] for q in qs}, scaled)), speed_intervals(b)
    rest = [math.log(throughput(b[q]) / (throughput(a[q]) * factor)) for q in sorted(set(qs) - set(measured), key=int)]
    return {"questions_measured": len(measured), "drift_factor": factor, "corrected_baseline": c["speedup"],
            "own_baseline": own["speedup"], "width_ratio": width(c) / width(own) if width(own) else None,
            "residual_log": {"mean": statistics.fmean(rest), "stdev": statistics.stdev(rest)} if len(rest) > 1 else None}


def drift(a: dict[str, dict], b: dict[str, dict]) -> dict:
    """The baseline's throughput in run b over run a, question by question."""
    ratios = sorted(throughput(b[q]) / throughput(a[q]) for q in a if q in b)
    return {"questions": len(ratios), "median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1],
            "stdev": statistics.pstdev(ratios)}


def settings(cfg: DictConfig) -> dict:
    given = OmegaConf.to_container(OmegaConf.select(cfg, "baseline_noise", default=OmegaConf.create({})), resolve=True)
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"baseline_noise.{unknown[0]} is not a setting; known: {sorted(DEFAULTS)}")
    return {**DEFAULTS, **given}


@stage
def main(cfg: DictConfig) -> None:
    s = settings(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [Path(tmp) / "first", Path(tmp) / "second"]
        for folder in runs:
            folder.mkdir()
        seconds = [run_references(folder, s["questions"]) for folder in runs]
        first, second = (per_question(folder, s["method"]) for folder in runs)
    out = {"what": "prompt lookup's speedup interval over its own run's baseline against over the other run's "
                   "(pipelines/bench/baseline_noise.py)", "method": s["method"], "questions": len(second),
           "host": host_record("cpu"), "seconds": seconds,
           "second_over_first": compare(first, second), "first_over_second": compare(second, first),
           "baseline_drift": drift(first, second),
           "corrected": {"second_over_first": corrected(first, second, int(s["correction_questions"])),
                         "first_over_second": corrected(second, first, int(s["correction_questions"]))}}
    write_json(REPO_ROOT / s["out"], out)
    for name in ("second_over_first", "first_over_second"):
        c = out[name]
        log.info("%s: speedup %.3f [%s] own baseline, %.3f [%s] shared; interval width x%.2f", name,
                 c["own_baseline"]["value"], c["own_baseline"]["ci"], c["shared_baseline"]["value"],
                 c["shared_baseline"]["ci"], c["width_ratio"])
    log.info("baseline drift, second run over first, per question: %s", out["baseline_drift"])
    for name, c in out["corrected"].items():
        log.info("%s, corrected on %d questions (drift x%.4f): %.3f %s against %.3f %s own", name,
                 c["questions_measured"], c["drift_factor"], c["corrected_baseline"]["value"],
                 c["corrected_baseline"]["ci"], c["own_baseline"]["value"], c["own_baseline"]["ci"])


if __name__ == "__main__":
    main()
