"""What each stage cost per unit of its work, from the stage metrics: the measured rates of the cost model in
docs/cost.md, so that a run on another machine, or another profile's amount of work, can be read against them.

    text = stage_rates_table(metrics={"prepare": {...}, "distill": {...}, "train_hydra": {...}, ...},
                             plain_step_s=0.11)
"""
from __future__ import annotations

from analysis.run_record import pipeline_order, stage_label, wall_time

CACHE_BUILT_S = 60.0      # a hidden-state cache read back takes seconds; one built takes a forward over every token


def _row(stage: str, unit: str, amount: float, seconds: float, rate: str) -> list[str]:
    return [stage, unit, f"{amount:,.0f}", f"{seconds:,.0f}", rate]


def _distill_rows(m: dict) -> list[list[str]]:
    rows, own, relabel = [], m.get("self") or {}, m.get("relabel") or {}
    if own.get("generation_s"):
        rows.append(_row("distill", "new tokens generated", own["new_tokens"], own["generation_s"],
                         f"{own['new_tokens'] / own['generation_s']:,.0f} tokens/s"))
    if relabel.get("relabel_s"):
        rows.append(_row("distill", "tokens teacher-forced (relabelled)", relabel["tokens"], relabel["relabel_s"],
                         f"{relabel['tokens'] / relabel['relabel_s']:,.0f} tokens/s"))
    return rows


def _train_rows(name: str, m: dict, cache_tokens: int | None) -> list[list[str]]:
    rows, label = [], stage_label(name)
    if cache_tokens and (m.get("cache_time_s") or 0) > CACHE_BUILT_S:   # this stage built the cache it trains on
        rows.append(_row(label, "hidden states cached (tokens)", cache_tokens, m["cache_time_s"],
                         f"{cache_tokens / m['cache_time_s']:,.0f} tokens/s"))
    per_s, positions = m.get("train_positions_per_s") or {}, m.get("train_targets_head0")
    if per_s and positions and m.get("fit_time_s"):
        rates = ", ".join(f"{stage} {v:,.0f}" for stage, v in per_s.items())
        rows.append(_row(label, f"training positions x epochs ({m.get('epochs')})", positions * (m.get("epochs") or 1),
                         m["fit_time_s"], f"{rates} positions/s"))
    return rows


def _answers(m: dict) -> int:
    """The answers an evaluate stage decoded: the baseline's and every method's, each question's turns."""
    methods = m.get("methods") or {}
    questions = sum(int(s.get("questions") or 0) for s in methods.values())
    turns = (m.get("lossless_checked_turns") or questions) / questions if questions else 1
    return round(turns * (questions + int(m.get("num_questions") or 0)))


def _decode_row(name: str, m: dict, plain_step_s: float | None) -> list[str]:
    answers, seconds = _answers(m), wall_time(m)
    steps = f", {seconds / answers / plain_step_s:,.0f} plain steps" if plain_step_s else ""
    return _row(stage_label(name), f"answers of up to {m.get('max_new_tokens')} new tokens", answers, seconds,
                f"{seconds / answers:,.1f} s an answer{steps}")


def _batch_row(name: str, m: dict) -> list[str]:
    cells = sum(len(sizes) for sizes in (m.get("tokens_per_s") or {}).values())
    return _row(stage_label(name), "(method, batch size) cells, every question each", cells, wall_time(m),
                f"{wall_time(m) / cells:,.0f} s a cell")


def stage_rate_rows(metrics: dict[str, dict], plain_step_s: float | None = None) -> list[list[str]]:
    """One row per stage and unit of work it has a measured rate for, in the order the stages run."""
    rows: list[list[str]] = []
    prep, dist = metrics.get("prepare") or {}, metrics.get("distill") or {}
    if prep.get("records_read") and wall_time(prep):
        rows.append(_row("prepare", "ShareGPT records read", prep["records_read"], wall_time(prep),
                         f"{prep['records_read'] / wall_time(prep):,.0f} records/s"))
    rows += _distill_rows(dist)
    cache_tokens = sum(int((dist.get(split) or {}).get("tokens") or 0) for split in ("train", "val")) or None
    for name in pipeline_order(metrics):
        m = metrics[name]
        if not isinstance(m, dict) or not wall_time(m):
            continue
        if name.startswith("train_"):
            rows += _train_rows(name, m, cache_tokens)
        elif (name == "references" or name.startswith("evaluate_")) and _answers(m):
            rows.append(_decode_row(name, m, plain_step_s))
        elif name.startswith("batch_") and m.get("tokens_per_s"):
            rows.append(_batch_row(name, m))
    return rows


def stage_rates_table(metrics: dict[str, dict], plain_step_s: float | None = None) -> str:
    rows = stage_rate_rows(metrics, plain_step_s)
    if not rows:
        return ""
    lines = ["| stage | unit of work | amount | seconds | rate |", "|---|---|---|---|---|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"
