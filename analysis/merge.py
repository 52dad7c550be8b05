"""One summary from the evaluate runs of the DVC chains: `references` (the baseline and both prompt lookups) and
evaluate@<heads> (the baseline and one family on its trees), each run with its own baseline.

    summary = merged_summary(Path("results/eval"), ["medusa1", "hydra"])     # references is always read

Every method keeps the figures of its own run: each speedup is over that run's baseline on the same question, so
two methods of different runs compare question by question through those ratios (analysis/comparisons.py pairs
them), as two methods of one run do. Greedy accepted lengths do not depend on the run. Each method records the run
it came from (`run`); the merged baseline is the references run's.
"""
from __future__ import annotations

import logging
from pathlib import Path

from analysis.tables import PLD_KINDS, load_summary

log = logging.getLogger("analysis.merge")
REFERENCES = "references"


def pld_speedups_on(method: dict, methods: dict[str, dict]) -> dict[str, float | None]:
    """{prompt lookup: its mean per-question speedup on the questions `method` ran} (what "beats prompt lookup" is
    judged on when a method ran on a subset, profile.eval.tree_questions)."""
    mine = set(method.get("per_question") or {})
    out = {}
    for name, m in methods.items():
        if m.get("kind") in PLD_KINDS:
            values = [r["speedup"] for q, r in (m.get("per_question") or {}).items()
                      if q in mine and r.get("speedup") is not None]
            out[name] = sum(values) / len(values) if values else None
    return out


def merged_summary(folder: Path, heads: list[str]) -> dict:
    """The references run and evaluate@<h> for each h in heads that has a summary (a missing one is logged), as one
    summary in the layout of results/eval/<tag>/summary.json (analysis/tables.py)."""
    refs = load_summary(Path(folder) / REFERENCES / "summary.json")
    runs = {REFERENCES: refs}
    for name in heads:
        path = Path(folder) / name / "summary.json"
        if path.is_file():
            runs[name] = load_summary(path)
        else:
            log.warning("no %s: evaluate@%s has not run; its methods are left out", path, name)
    for tag, run in runs.items():
        if run["model"] != refs["model"]:
            raise ValueError(f"results/eval/{tag} measured {run['model']!r}, the references run {refs['model']!r}")
    settings = {**refs.get("settings", {}), "tree_questions": {k: v for run in runs.values()
                                                                for k, v in run["settings"].get("tree_questions", {}).items()}}
    methods = {"baseline": {**refs["methods"]["baseline"], "run": REFERENCES}}
    for tag, run in runs.items():
        methods.update({n: {**m, "run": tag} for n, m in run["methods"].items() if n != "baseline"})
    for m in methods.values():
        if m["kind"] == "heads":
            m["pld_speedups"] = pld_speedups_on(m, methods)
    return {"tag": "+".join(runs), "model": refs["model"], "hardware": refs["hardware"], "profile": refs.get("profile"),
            "settings": settings, "baseline": "baseline", "lossless": all(r.get("lossless") for r in runs.values()),
            "runs": {tag: {"hardware": r["hardware"], "lossless": r.get("lossless"),
                           "baseline_tokens_per_s": r["methods"]["baseline"]["throughput"]["mean"]}
                     for tag, r in runs.items()},
            "methods": methods}
