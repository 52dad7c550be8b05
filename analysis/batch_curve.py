"""The batch curve: each method's throughput over the autoregressive baseline's at the same batch size B.

    runs = load_batch_runs("results/batch")                     # {tag: results/batch/<tag>/batch.json}
    rows = batch_rows(summary, runs)                            # a row per method and B
    text = batch_markdown(rows);  plot_batch_curve(rows, "reports/batch_curve.png")

B > 1 (pipelines/evaluate_batch.py): all new tokens over all wall time, prefills included, of the method's batches
over the baseline's batches of the same questions (the baseline runs in a stage of its own); the ratio of the
pooled figures, its 95% interval from resampling the batches together (models.measure.intervals). B = 1 is the
headline's: the same heads on their calibrated tree (<h>-optimal, <h>-optimal_pld, or the grown <h>-dynamic_optimal(_pld)
where calibrate chose it) over their own stage's baseline,
mean of per-question ratios with its interval (a batch of one question is a question).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from models.measure.intervals import bootstrap_columns

SUFFIXES = {"batch": ("alone", "optimal"), "batch_pld": ("with prompt lookup", "optimal_pld")}
GROWN = {"optimal": "dynamic_optimal", "optimal_pld": "dynamic_optimal_pld"}   # the same, grown per step


def headline_method(methods: dict, heads: str, headline: str) -> tuple[str, dict | None]:
    """The B = 1 row's method: the heads' calibrated fixed tree, or their grown one where that ran on more questions
    (calibrate chose it: profile.eval.unchosen_questions puts the other kind on fewer)."""
    fixed, grown = f"{heads}-{headline}", f"{heads}-{GROWN.get(headline, headline)}"
    n = {k: (methods.get(k) or {}).get("questions") or 0 for k in (fixed, grown)}
    name = grown if n[grown] > n[fixed] else fixed
    return name, methods.get(name)


def load_batch_runs(folder: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(Path(folder).glob("*/batch.json"))}


def _paired(method: dict, baseline: dict) -> dict | None:
    """The pooled throughput ratio of a method's batches over the baseline's of the same questions, its interval."""
    mine, base = method["batches"], baseline["batches"]
    if [b["questions"] for b in mine] != [b["questions"] for b in base]:
        raise ValueError("a method's batches and the baseline's hold different questions: rerun both stages with the "
                         "same profile.eval settings")
    cols = {"mt": [sum(len(a["tokens"]) for a in b["answers"]) for b in mine], "mw": [b["wall_time"] for b in mine],
            "bt": [sum(len(a["tokens"]) for a in b["answers"]) for b in base], "bw": [b["wall_time"] for b in base]}

    def ratio(c):
        return (c["mt"].sum(-1) / c["mw"].sum(-1)) / (c["bt"].sum(-1) / c["bw"].sum(-1))

    value = float(ratio({k: np.asarray(v, dtype=float) for k, v in cols.items()}))
    return {"speedup": value, "ci": bootstrap_columns(cols, ratio), "batches": len(mine),
            "questions": sum(len(b["questions"]) for b in mine),
            "tokens_per_s": sum(cols["mt"]) / sum(cols["mw"]), "baseline_tokens_per_s": sum(cols["bt"]) / sum(cols["bw"])}


def batch_rows(summary: dict | None, runs: dict[str, dict]) -> list[dict]:
    """A row per (heads, alone or with prompt lookup, B): speedup over the baseline at B with its interval."""
    base = (runs.get("baseline") or {}).get("methods", {}).get("baseline")
    if not base:
        return []
    rows = []
    for tag, run in sorted(runs.items()):
        if tag == "baseline":
            continue
        for name, per_b in run["methods"].items():
            heads, _, suffix = name.partition("-")
            label, headline = SUFFIXES.get(suffix, (suffix, None))
            source, one = headline_method((summary or {}).get("methods") or {}, heads, headline)
            if one and one.get("speedup", {}).get("mean") is not None:
                ci = ((one.get("intervals") or {}).get("speedup") or {}).get("ci")
                rows.append({"heads": heads, "variant": label, "batch_size": 1, "speedup": one["speedup"]["mean"],
                             "ci": ci, "batches": one.get("questions"), "source": f"headline {source}"})
            for B, entry in sorted(per_b.items(), key=lambda kv: int(kv[0])):
                if B in base:
                    rows.append({"heads": heads, "variant": label, "batch_size": int(B), **_paired(entry, base[B]),
                                 "source": f"batch {name}"})
    return rows


def batch_markdown(rows: list[dict]) -> str:
    if not rows:
        return ""
    sizes = sorted({r["batch_size"] for r in rows})
    lines = ["| method | " + " | ".join(f"B = {b}" for b in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for key in dict.fromkeys((r["heads"], r["variant"]) for r in rows):
        cells = {r["batch_size"]: r for r in rows if (r["heads"], r["variant"]) == key}
        fmt = lambda r: "-" if r is None else f"{r['speedup']:.2f}x" + (   # noqa: E731
            f" ({r['ci'][0]:.2f}-{r['ci'][1]:.2f})" if r.get("ci") else "")
        lines.append(f"| {key[0]} {key[1]} | " + " | ".join(fmt(cells.get(b)) for b in sizes) + " |")
    return "\n".join(lines) + "\n" + questions_note(rows)


def questions_note(rows: list[dict]) -> str:
    """The n behind the table: B = 1 is the headline's questions, B > 1 the curve's (profile.eval.batch_questions)."""
    one = sorted({r["batches"] for r in rows if r["batch_size"] == 1 and r.get("batches")})
    more = sorted({r["questions"] for r in rows if r["batch_size"] > 1 and r.get("questions")})
    parts = ([f"B = 1 on the headline's {'/'.join(map(str, one))} questions"] if one else []) + \
        ([f"B > 1 on {'/'.join(map(str, more))} questions in batches of B"] if more else [])
    return f"\n{'; '.join(parts)}.\n" if parts else ""


def plot_batch_curve(rows: list[dict], path) -> Path:
    """Speedup against B, a line per method (an empty plot saying so without rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key in dict.fromkeys((r["heads"], r["variant"]) for r in rows):
        pts = sorted((r["batch_size"], r["speedup"]) for r in rows if (r["heads"], r["variant"]) == key)
        ax.plot(*zip(*pts), marker="o", ls="-" if key[1] == "alone" else "--", label=f"{key[0]} {key[1]}")
    ax.axhline(1.0, color="k", lw=0.8)
    if not rows:
        ax.text(0.5, 0.5, "no batch size above 1 was run", ha="center", transform=ax.transAxes)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size B")
    ax.set_ylabel("throughput over the baseline at B")
    if rows:
        ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
