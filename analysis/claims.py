"""The papers' claims, each judged by our own paired comparison on the same questions.

    rows = claim_rows(summary, train={"medusa2": train_medusa2_metrics}, latency=latency_profile)

A row: the claim, the published figure (with its model and hardware), ours with its 95% interval and the
number of questions, the verdict, and, when the claim does not hold here, the measured reason in a few words.
Verdicts:
  reproduced       our interval lies on the claimed side of 1 (and, for a claimed size such as "1.31x", holds it)
  smaller here     faster, but the interval lies below the claimed size
  not reproduced   the interval holds 1: no clear difference on these questions
  reversed         the interval lies on the other side of 1 (on this hardware: a CPU, a 135M model)
"""
from __future__ import annotations

import functools

from analysis.comparisons import compare, compare_across_runs, describe, fmt_interval, stronger_pld_name


def _verdict(lo: float, hi: float, size: float | None = None) -> str:
    if hi < 1:
        return "reversed"
    if lo <= 1:
        return "not reproduced"
    if size is not None and hi < size:
        return "smaller here"
    return "reproduced"


def _method_speedup(summary: dict, name: str) -> dict | None:
    m = summary["methods"].get(name)
    if m is None:
        return None
    iv = (m.get("intervals") or {}).get("speedup") or {}
    return {"value": m["speedup"].get("mean"), "ci": iv.get("ci"), "questions": m.get("questions")}


def _step_cost(latency: dict | None, tokens: int) -> float | None:
    """A verify step of `tokens` tokens over a 1-token step, from the latency profile (None without it)."""
    if not latency:
        return None
    sizes, secs = latency.get("sizes") or [], latency.get("forward_lm_head_s") or []
    if tokens in sizes and 1 in sizes:
        return secs[sizes.index(tokens)] / secs[sizes.index(1)]
    return None


def _head0(train: dict | None) -> str:
    """"head-0 val top-1 .35 after the heads-only stage, .37 after the joint one" from train_medusa2.json."""
    if not train:
        return ""
    hist = train.get("val_top1_head0_by_epoch") or {}
    s1, s2 = hist.get("stage1") or [], hist.get("stage2") or []
    if not s1 or not s2:
        return ""
    return f"head-0 val top-1 {max(s1):.3f} heads-only, {max(s2):.3f} after the joint stage"


def _row(claim, published, ours, verdict, reason="") -> dict:
    return {"claim": claim, "published": published, "ours": ours, "verdict": verdict, "reason": reason}


def _medusa1_row(summary: dict, latency: dict | None) -> dict | None:
    """Medusa-1 speeds decoding up: its calibrated tree against the baseline (and why the papers' tree does not)."""
    s = _method_speedup(summary, "medusa1-optimal")
    if not s or s["value"] is None or not s["ci"]:
        return None
    big, reason = _method_speedup(summary, "medusa1-sparse64"), ""
    if big and big["value"] is not None and big["value"] < 1:
        cost = _step_cost(latency, 64)
        reason = (f"on the papers' 63-node tree it is {big['value']:.2f}x here"
                  + (f": verifying 64 tokens costs {cost:.1f}x a 1-token step on this CPU" if cost else ""))
    return _row("Medusa-1 speeds decoding up", "2.18x (Vicuna-7B, A100)",
                f"{s['value']:.2f}x ({fmt_interval(s['ci'])}), {s['questions']} questions, calibrated tree",
                _verdict(*s["ci"]), reason)


def _paired_row(summary, claim, published, a, b, size=None, why=None) -> dict | None:
    """A speed claim judged by the paired comparison of methods a and b; why(c): the reason where it fails."""
    c = compare(summary, a, b, "speedup")
    if c is None or c["interval"] is None:
        return None
    v = _verdict(*c["interval"], size)
    return _row(claim, published, describe(c) + f" ({c['a']} / {c['b']})", v,
                why(c) if why and v != "reproduced" else "")


def _accept_reason(summary: dict, a: str, b: str, extra: str = ""):
    """why(c) for a speed claim: the accepted-length ratio, and whether drafting ate the extra tokens."""
    def why(c):
        acc = compare(summary, a, b, "accept_length")
        parts = []
        if acc and acc["ratio"] is not None:
            parts.append(f"accepted length {acc['ratio']:.2f}x ({fmt_interval(acc['interval'])})")
        if extra:
            parts.append(extra)
        if acc and acc["interval"] and acc["interval"][0] > 1 and c["interval"][1] < acc["interval"][0]:
            parts.append("the extra tokens a step cost more drafting than they save")
        return "; ".join(parts)
    return why


def _tree_reason(summary: dict, latency: dict | None):
    """why(c) for the 63-node tree against a chain: what it accepts, what its verify step costs here."""
    def why(c):
        acc = compare(summary, c["a"], c["b"], "accept_length")
        cost, chain = _step_cost(latency, 64), _step_cost(latency, 4)
        parts = [] if not acc or acc["ratio"] is None else [f"it accepts {acc['ratio']:.2f}x the tokens a step"]
        if cost:
            parts.append(f"but verifying 64 tokens costs {cost:.1f}x a 1-token step here"
                         + (f" (4 tokens: {chain:.2f}x)" if chain else "") + ", about 1x on an A100")
        return ", ".join(parts)
    return why


MEDUSA2_PUBLISHED = "2.83x vs 2.18x: 1.30x (Vicuna-7B, A100)"


def _medusa2_row(summary: dict, train: dict, own: dict | None) -> dict | None:
    """Medusa-2 against Medusa-1 on their calibrated trees: from Medusa-2's own run (`medusa2-optimal`, heads
    trained after the main run) paired by question with the main run's Medusa-1 where there is one, else
    within the main run."""
    c = compare_across_runs(own, "medusa2-optimal", summary, "medusa1-optimal") if own else None
    if c is None or c["interval"] is None:
        why = functools.partial(_accept_reason, summary)("medusa2-optimal", "medusa1-optimal", _head0(train.get("medusa2")))
        return _paired_row(summary, "Medusa-2 beats Medusa-1", MEDUSA2_PUBLISHED, "medusa2-optimal", "medusa1-optimal",
                           why=why)
    acc = compare_across_runs(own, "medusa2-optimal", summary, "medusa1-optimal", "accept_length")
    v = _verdict(*c["interval"])
    reason = "; ".join(x for x in (acc and f"accepted length {describe(acc)}", _head0(train.get("medusa2"))) if x)
    return _row("Medusa-2 beats Medusa-1", MEDUSA2_PUBLISHED, describe(c) + f" ({c['a']} / {c['b']})", v,
                reason if v != "reproduced" else "")


EAGLE_RUNS = {"eagle": "eagle-optimal_pld", "eagle3": "eagle3-optimal_pld"}   # the runs of one method each that
# judge the EAGLE claims: a family's calibrated tree with prompt lookup merged in, and (eval.selected_trees) alone
PLD_PUBLISHED = {
    "eagle": ("EAGLE beats prompt lookup", "EAGLE 2.10x vs prompt lookup 1.66x: 1.27x (Spec-Bench, Vicuna-7B, A100)"),
    "eagle3": ("EAGLE-3 beats prompt lookup", "EAGLE-3 3.02x (Spec-Bench, Vicuna-13B) vs prompt lookup 1.66x "
                                              "(Vicuna-7B): 1.82x, across model sizes")}
EAGLE3_MEDUSA_PUBLISHED = "6.65 vs 2.59 accepted: 2.57x (EAGLE-3 paper, Vicuna-13B)"


def _eagle_pld_row(run: dict | None, family: str) -> dict | None:
    """A family's calibrated tree alone against the stronger prompt lookup: speed, paired by question (run: a run of
    its own, reports/metrics/evaluate_<tag>.json, or the summary)."""
    mine = f"{family}-optimal"
    if not run or mine not in run.get("methods", {}):
        return None
    pld = (run.get("strongest_pld") or {}).get("method") or stronger_pld_name(run)   # a run's metrics name it
    c = compare(run, mine, pld, "speedup") if pld else None
    if not (c and c["interval"]):
        return None
    acc = compare(run, mine, pld, "accept_length")
    v = _verdict(*c["interval"])
    reason = f"accepted length {describe(acc)}" if acc and acc["interval"] and v != "reproduced" else ""
    claim, published = PLD_PUBLISHED[family]
    where = run["methods"][mine].get("run") or run.get("tag")        # the merged summary: the method's own run
    return _row(claim, published, describe(c) + f" ({mine} / {pld}, run {where})", v, reason)


def _eagle_rows(runs: dict[str, dict], summary: dict) -> list[dict | None]:
    """EAGLE's claims from the EAGLE and EAGLE-3 runs of their own: each calibrated tree alone against its run's
    stronger prompt lookup, and EAGLE-3's accepted length against the main run's Medusa-1 on its calibrated tree
    (greedy accepted lengths do not depend on the run)."""
    rows = [_eagle_pld_row(runs.get(tag) or summary, family) for family, tag in EAGLE_RUNS.items()]
    run = runs.get(EAGLE_RUNS["eagle3"])
    c = compare_across_runs(run, "eagle3-optimal", summary, "medusa1-optimal", "accept_length") if run else \
        compare(summary, "eagle3-optimal", "medusa1-optimal", "accept_length")
    if c and c["interval"]:
        rows.append(_row("EAGLE-3 accepts more than Medusa", EAGLE3_MEDUSA_PUBLISHED,
                         describe(c) + f" ({c['a']} / {c['b']}, calibrated trees)", _verdict(*c["interval"], 2.57),
                         ""))
    return rows


EAGLE2_PUBLISHED = "2.36x vs 2.10x: 1.12x; 4.34 vs 3.58 accepted: 1.21x (Spec-Bench, Vicuna-7B, A100)"
EAGLE2_PAIR = ("eagle-dynamic_optimal", "eagle-optimal")   # EAGLE's heads on the tree grown per step / fixed tree


def _eagle2_row(summary: dict, runs: dict[str, dict]) -> dict | None:
    """EAGLE-2's claim: the EAGLE heads on their calibrated tree grown per step against the same heads on their
    calibrated fixed tree, paired by question within one run (evaluate@eagle, else EAGLE's run of its own)."""
    a, b = EAGLE2_PAIR
    for run in (summary, runs.get(EAGLE_RUNS["eagle"])):
        if run and a in run.get("methods", {}) and b in run["methods"]:
            why = functools.partial(_accept_reason, run)(a, b)
            return _paired_row(run, "EAGLE-2's dynamic tree beats EAGLE's static tree", EAGLE2_PUBLISHED, a, b,
                               size=1.12, why=why)
    return None


SPS_RUN = SPS_METHOD = "sps-optimal"   # the run that judges the draft model, and its method: the calibrated tree
SPS_PUBLISHED = "SpS 1.52x (Spec-Bench: Vicuna-7B with a 68M draft model, A100)"


def _plain(summary: dict) -> dict:
    """The summary's methods in a run's metrics layout (reports/metrics/evaluate_<tag>.json): plain figures."""
    def plain(m):
        iv = m.get("intervals") or {}
        return {"speedup": m["speedup"].get("mean"), "speedup_ci": (iv.get("speedup") or {}).get("ci"),
                "accept_length": m["accept_length"].get("mean"), "questions": m.get("questions")}
    tag = summary["methods"].get(SPS_METHOD, {}).get("run") or summary.get("tag")
    return {"tag": tag, "methods": {n: plain(m) for n, m in summary["methods"].items()}}


def _sps_row(run: dict | None) -> dict | None:
    """The draft model's speedup over its run's baseline, with transformers' assisted generation (the same draft
    model) and the accepted lengths as the reason (run: a run of its own, or _plain(summary))."""
    m = (run or {}).get("methods", {}).get(SPS_METHOD)
    if not (m and m.get("speedup_ci")):
        return None
    hf, v = run["methods"].get("sps_hf") or {}, _verdict(*m["speedup_ci"])
    reason = f"{m['accept_length']:.2f} tokens accepted a step" + (
        f"; transformers' assisted generation with the same draft model {hf['speedup']:.2f}x "
        f"({fmt_interval(hf.get('speedup_ci'))})" if hf.get("speedup") else "")
    return _row("A draft model (SpS) speeds decoding up", SPS_PUBLISHED,
                f"{m['speedup']:.2f}x ({fmt_interval(m['speedup_ci'])}), {m.get('questions')} questions, run {run.get('tag')}",
                v, reason if v != "reproduced" else "")


DFLASH_PUBLISHED = ("4.24 vs 2.83 accepted: 1.50x; 2.75x vs 1.63x: 1.69x (DFlash paper, Qwen3-8B, MT-Bench, greedy, "
                    "H200; EAGLE-3 on a 16-token tree)")
VERDICT_ORDER = ("reversed", "not reproduced", "smaller here", "reproduced")
CALIBRATED = ("optimal", "dynamic_optimal")             # the calibrated trees, fixed and grown per step


def calibrated_pair(summary: dict, family: str, other: str) -> tuple[str, str]:
    """family's calibrated tree of the kind its calibration chose (the one it ran on the most questions: the other
    kind runs on profile.eval.unchosen_questions; fixed on a tie or where neither ran), and other's of that kind."""
    ms = summary["methods"]
    ran = [t for t in CALIBRATED if f"{family}-{t}" in ms]
    tree = max(ran, key=lambda t: (len(ms[f"{family}-{t}"].get("per_question") or {}), t == "optimal"),
               default="optimal")
    return f"{family}-{tree}", f"{other}-{tree}"


def _dflash_row(summary: dict) -> dict | None:
    """DFlash against EAGLE-3, both on the calibrated kind DFlash's calibration chose (EAGLE-3 runs both on every
    question), paired by question: accepted length and speed, each judged at its published size; the row's verdict
    is the weaker of the two."""
    a, b = calibrated_pair(summary, "dflash", "eagle3")
    speed, acc = compare(summary, a, b, "speedup"), compare(summary, a, b, "accept_length")
    if not (speed and speed["interval"] and acc and acc["interval"]):
        return None
    verdicts = {"accepted length": _verdict(*acc["interval"], 1.50), "speed": _verdict(*speed["interval"], 1.69)}
    verdict = min(verdicts.values(), key=VERDICT_ORDER.index)
    reason = "; ".join(f"{what}: {v}" for what, v in verdicts.items() if v != "reproduced")
    return _row("DFlash accepts more than EAGLE-3, and runs faster", DFLASH_PUBLISHED,
                f"accepted {describe(acc)}; speed {describe(speed)} ({a} / {b})", verdict, reason)


DSPARK_PUBLISHED = {   # the other method: (the published figures, their ratio)
    "dflash": ("3.72 vs 3.11 accepted: 1.20x (DSpark paper, Qwen3-8B, MT-Bench, T = 1, chains of 7; Qwen3-4B: 3.64 vs "
               "3.07)", 1.20),
    "eagle3": ("3.72 vs 2.66 accepted: 1.40x (DSpark paper, Qwen3-8B, MT-Bench, T = 1, chains of 7; Qwen3-4B: 3.64 vs "
               "2.39)", 1.40)}


def _dspark_rows(summary: dict) -> list[dict]:
    """DSpark against DFlash and against EAGLE-3 in accepted length, each on the calibrated kind DSpark's calibration
    chose, paired by question (greedy here, the paper's T = 1), judged at the published size."""
    rows = []
    for other, (published, size) in DSPARK_PUBLISHED.items():
        a, b = calibrated_pair(summary, "dspark", other)
        c = compare(summary, a, b, "accept_length")
        if c and c["interval"]:
            rows.append(_row(f"DSpark accepts more than {'DFlash' if other == 'dflash' else 'EAGLE-3'}", published,
                             describe(c) + f" ({a} / {b})", _verdict(*c["interval"], size)))
    return rows


BATCH_CLAIMS = (   # (claim, published, heads, the batch size it names, holds when the speedup there is above 1)
    ("EAGLE-3 still pays at batch 64", "1.38x at batch 64 (EAGLE-3 paper: SGLang, H100, LLaMA-3.1-8B, a chain of 3)",
     "eagle3", 64, True),
    ("EAGLE-1 falls below 1x by batch 24", "below 1x from batch 24 (EAGLE-3 paper: SGLang, H100, LLaMA-3.1-8B)",
     "eagle", 24, False))


def _batch_rows(batch: list[dict] | None) -> list[dict]:
    """The batch claims, judged on this machine's batch curve (analysis/batch_curve.py) at the batch size they name;
    where the curve stops short of it, its last point is shown and the claim left unjudged."""
    out = []
    for claim, published, heads, size, above in BATCH_CLAIMS:
        points = sorted((r for r in batch or [] if r["heads"] == heads and r["variant"] == "alone"),
                        key=lambda r: r["batch_size"])
        if not points:
            continue
        at = next((r for r in points if r["batch_size"] >= size), None)
        last = at or points[-1]
        ci = last.get("ci")
        ours = (f"{last['speedup']:.2f}x" + (f" ({fmt_interval(ci)})" if ci else "") + f" at batch {last['batch_size']}"
                f" ({heads}, its tree for that batch size)")
        if at is None or not ci:
            out.append(_row(claim, published, ours, "not judged here",
                            f"the curve stops at batch {points[-1]['batch_size']} (profile.eval.batch_sizes); a CPU's "
                            "verify step grows with the batch from the start, a GPU's only once compute-bound"))
            continue
        v = _verdict(*ci) if above else {"reversed": "reproduced", "reproduced": "reversed"}.get(_verdict(*ci),
                                                                                              "not reproduced")
        out.append(_row(claim, published, ours, v, ""))
    return out


def claim_rows(summary: dict, train: dict[str, dict] | None = None, latency: dict | None = None,
               single_runs: dict[str, dict] | None = None, batch: list[dict] | None = None) -> list[dict]:
    """One row per claim of the papers that this run can judge (a claim whose methods did not run is left out);
    single_runs: {tag: reports/metrics/evaluate_<tag>.json}, of which `medusa2-optimal` judges Medusa-2 and
    `eagle-optimal_pld`, `eagle3-optimal_pld` (each on its calibrated tree with and without prompt lookup) the
    EAGLE claims; EAGLE-2's is judged by eagle-dynamic_optimal against eagle-optimal (one run), DFlash's by
    DFlash's against EAGLE-3 and DSpark's against both, each on the calibrated kind the family's calibration chose."""
    train, why = train or {}, functools.partial(_accept_reason, summary)
    rows = [_medusa1_row(summary, latency), _medusa2_row(summary, train, (single_runs or {}).get("medusa2-optimal"))]
    c = compare(summary, "hydra-sparse64", "medusa1-sparse64", "accept_length")
    if c and c["interval"]:
        rows.append(_row("Hydra beats Medusa in accepted length", "3.04 vs 2.58: 1.18x (Vicuna-7B, 63-node tree)",
                         describe(c) + " (63-node tree)", _verdict(*c["interval"])))
    rows += [
        _paired_row(summary, "Hydra beats Medusa in speed", "2.36x vs 2.13x: 1.11x (Vicuna-7B)", "hydra-optimal",
                    "medusa1-optimal", why=why("hydra-optimal", "medusa1-optimal")),
        _paired_row(summary, "Hydra++ beats Hydra", "2.70x vs 2.36x: 1.14x; 3.70 vs 3.04 accepted (Vicuna-7B)",
                    "hydra_pp-optimal", "hydra-optimal", why=why("hydra_pp-optimal", "hydra-optimal")),
        _paired_row(summary, "Hydra++ is 1.31x Medusa", "up to 1.31x (Vicuna-33B: 2.53x vs 1.93x; Vicuna-7B 1.27x)",
                    "hydra_pp-optimal", "medusa1-optimal", size=1.31, why=why("hydra_pp-optimal", "medusa1-optimal")),
        _paired_row(summary, "The 63-node tree beats a chain",
                    "the tree over a chain in Medusa's ablation (A100; no single figure)", "medusa1-sparse64",
                    "medusa1-chain4", why=_tree_reason(summary, latency))]
    rows += _eagle_rows(single_runs or {}, summary)
    rows.append(_eagle2_row(summary, single_runs or {}))
    rows.append(_sps_row((single_runs or {}).get(SPS_RUN) or _plain(summary)))
    rows.append(_dflash_row(summary))
    rows += _dspark_rows(summary)
    rows += _batch_rows(batch)                              # batch: analysis.batch_curve.batch_rows
    return [r for r in rows if r is not None]


def claims_markdown(rows: list[dict]) -> str:
    lines = ["| Claim | Published | Ours (95% interval) | Verdict | Why, where it does not hold |", "|---|---|---|---|---|"]
    lines += [f"| {r['claim']} | {r['published']} | {r['ours']} | {r['verdict']} | {r['reason'] or '-'} |" for r in rows]
    return "\n".join(lines) + "\n"
