"""Paired comparisons of methods over the same MT-Bench questions, and the papers' claims judged by them.

    rows = standard_comparisons(summary)       # family vs prompt lookup, Hydra++ vs Hydra, merged vs alone, ...
    claims = claim_rows(summary, train_metrics={"medusa2": {...}})

Every "A beats B" this repository states comes from here: the per-question values of the two methods
(speedup over the baseline of the method's own run, or accepted tokens per step) on the questions both ran, the
ratio of their means with a 95% paired bootstrap interval (models/measure/intervals.py), and the questions A wins.
The summary is results/eval/<tag>/summary.json (pipelines/evaluate.py), or the runs of the DVC chains merged
(analysis/merge.py); its methods carry `per_question`.
"""
from __future__ import annotations

from dataclasses import dataclass

from models.measure.intervals import paired_comparison, verdict

FAMILY_LABELS = {"medusa1": "Medusa-1", "medusa2": "Medusa-2", "hydra": "Hydra", "hydra_pp": "Hydra++", "eagle": "EAGLE",
                 "eagle3": "EAGLE-3", "sps": "SpS (draft model)", "dflash": "DFlash",
                 "dspark": "DSpark"}
PLD_LABELS = {"pld": "prompt lookup (ours)", "pld_hf": "prompt lookup (transformers)"}
HF_GENERATE = "hf_generate"        # the method (and kind) of transformers' own greedy generate, no drafting
HF_GENERATE_LABEL = "transformers' greedy generate (no drafting)"
METRIC_LABELS = {"speedup": "speed", "accept_length": "accepted length"}


def per_question_values(method: dict, metric: str) -> dict[str, float]:
    """{question id: value} of one method: its speedup over the baseline on that question, or its accepted
    tokens per step there."""
    return {q: r[metric] for q, r in (method.get("per_question") or {}).items() if r.get(metric) is not None}


def compare(summary: dict, a: str, b: str, metric: str = "speedup") -> dict | None:
    """Paired comparison of methods a and b (names in summary["methods"]); None when either is missing."""
    ms = summary["methods"]
    if a not in ms or b not in ms:
        return None
    out = paired_comparison(per_question_values(ms[a], metric), per_question_values(ms[b], metric))
    return {"a": a, "b": b, "metric": metric, **out, "verdict": verdict(out)}


def compare_across_runs(single: dict, a: str, summary: dict, b: str, metric: str = "speedup") -> dict | None:
    """Method a of a run of its own (reports/metrics/evaluate_<tag>.json, with per_question) against method b of
    the main run, paired by question: each speedup is over its own run's baseline on that question, and greedy
    accepted lengths do not depend on the run. None when either is missing."""
    ma, mb = (single or {}).get("methods", {}).get(a), summary["methods"].get(b)
    if not ma or not ma.get("per_question") or not mb:
        return None
    out = paired_comparison(per_question_values(ma, metric), per_question_values(mb, metric))
    return {"a": f"{a} (run {single.get('tag')})", "b": b, "metric": metric, **out, "verdict": verdict(out)}


def stronger_pld_name(summary: dict) -> str | None:
    """The prompt lookup with the higher mean speedup over the whole run."""
    plds = [(n, m["speedup"].get("mean")) for n, m in summary["methods"].items() if m["kind"] in PLD_LABELS]
    plds = [(n, v) for n, v in plds if v is not None]
    return max(plds, key=lambda nv: nv[1])[0] if plds else None


def faster_ar_loop(baseline_tps: float | None, hf_tps: float | None) -> tuple[str, float]:
    """The faster of the two autoregressive loops on this machine, our baseline ("baseline") or transformers' greedy
    generate (HF_GENERATE), from their tokens/s in the same stage, and the factor that turns a speedup over our
    baseline into one over the faster loop: baseline_tps / hf_tps where transformers' is faster, else 1 (the figures
    stand). Without both rates: the baseline, 1."""
    if baseline_tps and hf_tps and hf_tps > baseline_tps:
        return HF_GENERATE, baseline_tps / hf_tps
    return "baseline", 1.0


def label(summary: dict, name: str) -> str:
    m = summary["methods"].get(name, {})
    if m.get("kind") in PLD_LABELS:
        return PLD_LABELS[m["kind"]]
    if m.get("kind") == HF_GENERATE:
        return HF_GENERATE_LABEL
    if m.get("kind") == "heads":
        return f"{FAMILY_LABELS.get(m['heads'], m['heads'])}, {m['tree']}"
    return name


@dataclass
class Comparison:
    question: str            # what is asked, in words
    a: str                   # method names
    b: str
    metric: str              # speedup | accept_length


def standard_questions(summary: dict) -> list[Comparison]:
    """The comparisons the results document reports, for the methods this run has."""
    ms = summary["methods"]
    heads = list(dict.fromkeys(m["heads"] for m in ms.values() if m["kind"] == "heads"))
    pld = stronger_pld_name(summary)
    out = []

    def add(question, a, b, metric="speedup"):
        if a in ms and b in ms:
            out.append(Comparison(question, a, b, metric))

    for h in heads:                                     # each family against prompt lookup, alone and merged
        if pld:
            add(f"{FAMILY_LABELS.get(h, h)} alone beats prompt lookup", f"{h}-optimal", pld)
            add(f"{FAMILY_LABELS.get(h, h)} with prompt lookup merged in beats prompt lookup", f"{h}-optimal_pld", pld)
    for h in heads:
        add(f"{FAMILY_LABELS.get(h, h)}: merging prompt lookup in beats the heads alone", f"{h}-optimal_pld", f"{h}-optimal")
    for h in heads:                                     # the tree grown per step against the calibrated fixed tree
        for metric in ("accept_length", "speedup"):
            add(f"{FAMILY_LABELS.get(h, h)}: the tree grown per step beats the calibrated fixed tree "
                f"({METRIC_LABELS[metric]})", f"{h}-dynamic_optimal", f"{h}-optimal", metric)
        if pld:
            add(f"{FAMILY_LABELS.get(h, h)} on the tree grown per step beats prompt lookup", f"{h}-dynamic_optimal", pld)
    for h in heads:                                     # a tree cut per step (DSpark's by its confidence head) uncut
        for metric in ("accept_length", "speedup"):
            add(f"{FAMILY_LABELS.get(h, h)}: cutting the 16-node tree per step beats the same tree uncut "
                f"({METRIC_LABELS[metric]})", f"{h}-cut", f"{h}-uncut", metric)
    for a, b in (("hydra", "medusa1"), ("hydra_pp", "hydra"), ("hydra_pp", "medusa1"), ("medusa2", "medusa1")):
        for metric in ("accept_length", "speedup"):
            add(f"{FAMILY_LABELS[a]} beats {FAMILY_LABELS[b]} ({METRIC_LABELS[metric]}, calibrated trees)",
                f"{a}-optimal", f"{b}-optimal", metric)
        add(f"{FAMILY_LABELS[a]} beats {FAMILY_LABELS[b]} (accepted length, the papers' 63-node tree)",
            f"{a}-sparse64", f"{b}-sparse64", "accept_length")
    for h in heads:
        add(f"{FAMILY_LABELS.get(h, h)}: the 63-node tree beats a 4-token chain (speed)", f"{h}-sparse64", f"{h}-chain4")
    return out


def standard_comparisons(summary: dict) -> list[dict]:
    """standard_questions, each with its paired comparison."""
    rows = []
    for c in standard_questions(summary):
        r = compare(summary, c.a, c.b, c.metric)
        if r is not None and r["questions"]:
            rows.append({"question": c.question, "a_label": label(summary, c.a), "b_label": label(summary, c.b), **r})
    return rows


def fmt_interval(ci) -> str:
    return "-" if not ci else f"{ci[0]:.2f} to {ci[1]:.2f}"


def describe(row: dict) -> str:
    """"1.08x (1.03 to 1.13), ahead on 61 of 80" for a comparison row."""
    if row.get("ratio") is None:
        return "-"
    return (f"{row['ratio']:.2f}x ({fmt_interval(row['interval'])}), ahead on {row['wins']} of {row['questions']}")
