"""What a run was: machine, model, data, training figures and stage times, from the stage metrics files
(reports/metrics/*.json) and the evaluate summary. The top of the results document.

    text = run_markdown(summary, metrics={"prepare": {...}, "distill": {...}, "train_hydra": {...}, ...})
"""
from __future__ import annotations

from analysis.comparisons import FAMILY_LABELS


def _minutes(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    m, s = divmod(int(round(seconds)), 60)
    return f"{m} min {s:02d} s"


def _train_runs(metrics: dict[str, dict]) -> dict[str, dict]:
    """{family: its train metrics}, in the papers' order, then any other family by name."""
    runs = {name[len("train_"):]: m for name, m in metrics.items() if name.startswith("train_")}
    return {f: runs[f] for f in [*[f for f in FAMILY_LABELS if f in runs], *sorted(set(runs) - set(FAMILY_LABELS))]}


def _epochs(m: dict) -> str:
    best = m.get("best_epoch") or {}
    if "stage1" in best:  # a two-stage recipe: heads only, then joint
        steps = m.get("steps") or {}
        return f"{m.get('epochs')} ({steps.get('stage1', 0):,} heads-only steps, {steps.get('stage2', 0):,} joint)"
    return str(m.get("epochs"))


def _speeds(m: dict) -> str:
    per_s = m.get("train_positions_per_s") or {}
    return ", ".join(f"{stage} {v:,.0f}" for stage, v in per_s.items()) or "-"


def training_table(metrics: dict[str, dict]) -> str:
    runs = _train_runs(metrics)
    if not runs:
        return ""
    heads = max(len(m.get("val_top1") or {}) for m in runs.values())
    lines = ["| heads | " + " | ".join(f"head {k} top-1" for k in range(heads))
             + " | epochs | positions/s | wall time |", "|---|" + "---|" * (heads + 3)]
    for name, m in runs.items():
        top1 = m.get("val_top1") or {}
        cells = [f"{top1[f'head{k}']:.3f}" if f"head{k}" in top1 else "-" for k in range(heads)]
        lines.append(f"| {FAMILY_LABELS.get(name, name)} | " + " | ".join(cells)
                     + f" | {_epochs(m)} | {_speeds(m)} | {_minutes(m.get('wall_time_s'))} |")
    return "\n".join(lines) + "\n"


def stage_times_table(metrics: dict[str, dict]) -> str:
    """The stages whose metrics record their wall time (calibrate and evaluate are in their MLflow runs)."""
    order = ["prepare", "distill"] + [f"train_{f}" for f in FAMILY_LABELS]
    names = [n for n in order if n in metrics] + sorted(n for n in metrics if n not in order)
    rows = [(n, metrics[n]["wall_time_s"]) for n in names if isinstance(metrics[n], dict) and metrics[n].get("wall_time_s")]
    if not rows:
        return ""
    lines = ["| stage | wall time |", "|---|---|"]
    lines += [f"| {name.replace('train_', 'train@')} | {_minutes(t)} |" for name, t in rows]
    return "\n".join(lines) + "\n"


def data_line(metrics: dict[str, dict]) -> str:
    prep, dist = metrics.get("prepare") or {}, metrics.get("distill") or {}
    parts = []
    if prep:
        parts.append(f"ShareGPT: {prep.get('records_read', '?'):,} records read, {prep.get('kept', '?'):,} conversations "
                     f"kept ({prep.get('train', '?'):,} train, {prep.get('val', '?'):,} val)")
    train = dist.get("train") or {}
    if train:
        src = ", ".join(f"{k} {train[k]['answer_positions']:,}" for k in ("self", "relabel") if k in train)
        parts.append(f"training targets: {train.get('answer_positions', 0):,} answer positions ({src}) in "
                     f"{train.get('conversations', 0):,} conversations")
    return "; ".join(parts) + "." if parts else ""


def run_markdown(summary: dict, metrics: dict[str, dict]) -> str:
    base = summary.get("methods", {}).get(summary.get("baseline", "baseline"), {})
    tps = (base.get("throughput") or {}).get("mean")
    out = [f"Model {summary.get('model')} on a {summary.get('hardware')}, profile `{summary.get('profile')}`"
           + (f"; the autoregressive baseline decoded {tps:.1f} tokens/s." if tps else ".")]
    data = data_line(metrics)
    if data:
        out.append(data)
    table = training_table(metrics)
    if table:
        out += ["", "Training (`reports/metrics/train_<heads>.json`): val top-1 of each head at the kept epoch.", "",
                table]
    times = stage_times_table(metrics)
    if times:
        out += ["Stage times (from the stages' metrics):", "", times]
    return "\n".join(out) + "\n"
