"""PNG plots from an evaluate summary (matplotlib, Agg backend: no display needed).

    python -m pipelines.tables            (the stage; this module is the library)

    plot_speedup_per_category(summary, "reports/speedup_per_category.png")
    plot_accept_histogram(summary, "reports/accept_length_histogram.png")
    plot_speedup_vs_tree_size(summary, "reports/speedup_vs_tree_size.png")
    plot_calibration(rows, "reports/calibration.png")     # rows from analysis.calibration_tables.calibration_rows
    plot_data_scaling(record, "reports/bench/data_scaling.png")   # record from pipelines.bench.scaling
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from analysis.tables import CATEGORIES, PLD_KINDS, ours_label  # noqa: E402


def _methods(summary: dict, tree: str | None) -> dict[str, dict]:
    """Head methods on `tree` (all trees when None) plus both prompt lookups."""
    return {name: m for name, m in summary["methods"].items()
            if (m["kind"] == "heads" and (tree is None or m["tree"] == tree)) or m["kind"] in PLD_KINDS}


def save_figure(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")   # the saved canvas grows to hold the whole titles and labels
    plt.close(fig)
    return path


def plot_speedup_per_category(summary: dict, path, tree: str | None = None) -> Path:
    """Grouped bars: speedup per MT-Bench category, one bar per method (on `tree`), std as error bars."""
    methods = _methods(summary, tree)
    cats = [c for c in CATEGORIES if any(c in m.get("per_category", {}) for m in methods.values())]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(cats) + 2), 4))
    width = 0.8 / max(1, len(methods))
    for i, (name, m) in enumerate(methods.items()):
        stats = [m["per_category"].get(c, {}).get("speedup") or {} for c in cats]
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(cats))]
        ax.bar(xs, [s.get("mean") or 0.0 for s in stats], width, yerr=[s.get("std") or 0.0 for s in stats],
               label=name, capsize=2)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(cats)), cats, rotation=30)
    ax.set_ylabel("speedup over autoregressive")
    ax.set_title(f"Speedup per category: {ours_label(summary, tree)}", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    return save_figure(fig, path)


def plot_accept_histogram(summary: dict, path, tree: str | None = None) -> Path:
    """Share of decoding steps that emitted 1, 2, 3, ... tokens, one bar group per method."""
    methods = _methods(summary, tree)
    lengths = sorted({int(k) for m in methods.values() for k in m.get("accept_length_histogram", {})}) or [1]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(lengths) + 3), 4))
    width = 0.8 / max(1, len(methods))
    for i, (name, m) in enumerate(methods.items()):
        hist = {int(k): v for k, v in m.get("accept_length_histogram", {}).items()}
        total = sum(hist.values()) or 1
        xs = [x + (i - (len(methods) - 1) / 2) * width for x in lengths]
        ax.bar(xs, [hist.get(x, 0) / total for x in lengths], width, label=name)
    ax.set_xticks(lengths)
    ax.set_xlabel("tokens emitted per decoding step (accepted drafts + 1)")
    ax.set_ylabel("share of steps")
    ax.set_title(f"Accepted length: {ours_label(summary, tree)}", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    return save_figure(fig, path)


def plot_speedup_vs_tree_size(summary: dict, path) -> Path:
    """Speedup against the number of tree nodes, one colour per heads name: end to end (solid) and
    decode-only (dashed); the prompt lookups as horizontal lines (tree-independent)."""
    by_heads: dict[str, list] = {}
    for m in summary["methods"].values():
        if m["kind"] == "heads" and m.get("tree_nodes") and m["speedup"].get("mean") is not None:
            decode = (m.get("decode_speedup") or {}).get("mean")
            by_heads.setdefault(m["heads"], []).append(
                (m["tree_nodes"], m["speedup"]["mean"], m["speedup"]["std"] or 0.0, decode, m["tree"]))
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for heads, pts in sorted(by_heads.items()):
        pts.sort()
        line = ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", label=heads,
                           capsize=2)
        decode = [(p[0], p[3]) for p in pts if p[3] is not None]
        if decode:
            ax.plot([d[0] for d in decode], [d[1] for d in decode], marker=".", linestyle="--",
                    color=line.lines[0].get_color(), label=f"{heads} decode-only")
        for n, s, _, _, tree in pts:
            ax.annotate(tree, (n, s), fontsize=6, xytext=(3, 3), textcoords="offset points")
    for (name, m), style in zip(((n, m) for n, m in summary["methods"].items() if m["kind"] in PLD_KINDS), (":", "-.")):
        if m["speedup"].get("mean") is not None:
            ax.axhline(m["speedup"]["mean"], color="grey", linewidth=1.0, linestyle=style, label=f"{name} (end to end)")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree nodes (draft tokens verified per step)")
    ax.set_ylabel("speedup over autoregressive")
    ax.set_title(f"Speedup vs tree size (solid: end to end, dashed: decode-only): {ours_label(summary)}", fontsize=8)
    ax.legend(fontsize=6, ncol=2)
    return save_figure(fig, path)


def plot_calibration(rows: list[dict], path, title: str = "") -> Path:
    """Predicted accepted length per node budget (lines) and the measured ones (markers)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    if not rows:
        ax.text(0.5, 0.5, "no results/calibrate/*/calibration.json", ha="center", va="center", transform=ax.transAxes)
    for heads in sorted({r["heads"] for r in rows}):
        pts = [r for r in rows if r["heads"] == heads]
        greedy = [r for r in pts if r.get("tree", "budget").startswith("budget")]   # the calibrated trees: lines
        line, = ax.plot([r["budget"] for r in greedy], [r["predicted"] for r in greedy], marker=".",
                        label=f"{heads} predicted")
        replayed = [r for r in greedy if r.get("replayed") is not None]
        if replayed:
            ax.plot([r["budget"] for r in replayed], [r["replayed"] for r in replayed], ls=":", color=line.get_color(),
                    label=f"{heads} replayed (held-out)")
        meas = [r for r in pts if r["measured"] is not None]
        if meas:
            ax.scatter([r["budget"] for r in meas], [r["measured"] for r in meas], marker="x", s=60,
                       color=line.get_color(), label=f"{heads} measured (MT-Bench)")
            for r in meas:
                ax.annotate(r.get("measured_tree") or "", (r["budget"], r["measured"]), fontsize=6,
                            xytext=(3, -8), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree nodes (budget)")
    ax.set_ylabel("mean accepted tokens per step")
    ax.set_title(title or "Calibration: predicted vs measured accepted length", fontsize=9)
    if rows:
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def _forest(ax, labels: list[str], values: list[float], cis: list, colors: list[str] | None = None) -> None:
    """Horizontal points with their interval bars, first label on top."""
    ys = list(range(len(labels)))[::-1]
    for y, v, ci, c in zip(ys, values, cis, colors or ["C0"] * len(labels)):
        if ci:
            ax.plot(ci, [y, y], color=c, linewidth=2)
        ax.plot([v], [y], "o", color=c)
    ax.set_yticks(ys, labels, fontsize=7)
    ax.axvline(1.0, color="black", linewidth=0.8, linestyle="--")


def plot_speedup_intervals(summary: dict, path) -> Path:
    """Every method's end-to-end speedup (Spec-Bench) with its 95% bootstrap interval over questions; the number
    of questions beside each label (the sweeps run on a subset)."""
    rows = [(name, m) for name, m in summary["methods"].items()
            if m["kind"] in ("heads", *PLD_KINDS) and (m.get("intervals") or {}).get("speedup", {}).get("value")]
    fig, ax = plt.subplots(figsize=(6.5, 0.22 * len(rows) + 1.5))
    if rows:
        iv = [m["intervals"]["speedup"] for _, m in rows]
        colors = ["C1" if m["kind"] in PLD_KINDS else "C0" for _, m in rows]
        _forest(ax, [f"{name} ({m['questions']} q)" for name, m in rows], [i["value"] for i in iv],
                [i["ci"] for i in iv], colors)
    ax.set_xlabel("speedup over autoregressive, end to end (95% bootstrap interval over questions)")
    ax.set_title(f"Speedup with intervals: {ours_label(summary)}", fontsize=8)
    return save_figure(fig, path)


def plot_comparisons(rows: list[dict], path, title: str = "") -> Path:
    """Paired comparisons (analysis.comparisons.standard_comparisons): ratio A / B with its 95% interval; right of
    the dashed line A is ahead."""
    rows = [r for r in rows if r.get("ratio") is not None]
    fig, ax = plt.subplots(figsize=(7, 0.25 * len(rows) + 1.5))
    if rows:
        colors = ["C2" if r["interval"] and r["interval"][0] > 1 else "C3" if r["interval"] and r["interval"][1] < 1
                  else "grey" for r in rows]
        _forest(ax, [f"{r['question']} ({r['wins']}/{r['questions']})" for r in rows], [r["ratio"] for r in rows],
                [r["interval"] for r in rows], colors)
    ax.set_xlabel("ratio A / B of mean per-question values (paired 95% bootstrap interval)")
    ax.set_title(title or "Paired comparisons (green: A ahead, red: B ahead, grey: no clear difference)", fontsize=8)
    return save_figure(fig, path)


def plot_data_scaling(record: dict, path, budgets: tuple[str, ...] = ("4", "16")) -> Path:
    """pipelines.bench.scaling's record: replayed accepted length against train targets (log2), one line per
    family and budget (left), and each ratio to the first family (right)."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for heads, fam in record["families"].items():
        pts = list(fam["points"].values())
        for ls, b in zip(("-", "--", ":"), budgets):
            ax.plot([p["train_targets_head0"] for p in pts], [p["replay_accept_length"].get(b) for p in pts],
                    marker="o", ls=ls, label=f"{heads}, {b} nodes")
    for name, r in record["ratios"].items():
        rows = list(r["by_data"].values())
        for ls, b in zip(("-", "--", ":"), budgets):
            bx.plot([x["train_targets_head0"] for x in rows], [x["by_budget"].get(b) for x in rows], marker="o",
                    ls=ls, label=f"{name.replace('_over_', ' / ')}, {b} nodes")
    bx.axhline(1.0, color="grey", lw=0.8)
    for a, ylabel in ((ax, "replayed accepted tokens a step"), (bx, "ratio of accepted lengths")):
        a.set_xscale("log", base=2)
        a.set_xlabel("train targets (head-0 positions)")
        a.set_ylabel(ylabel)
        a.legend(fontsize=7)
    fig.suptitle("Draft quality against training data (same val set, same epochs)", fontsize=9)
    return save_figure(fig, path)
