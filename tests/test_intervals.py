"""Bootstrap intervals, paired comparisons, and the claims and results document built on them."""
import random

import pytest

from analysis.claims import claim_rows
from analysis.comparisons import compare, standard_comparisons
from analysis.results import results_markdown, step_cost_rows
from models.measure.benchmark import TurnRecord, speedup, summarize_method
from models.measure.intervals import (bootstrap_interval, bootstrap_ratio_interval, interval_of_mean,
                                      paired_comparison, verdict)


def test_bootstrap_of_a_two_point_distribution_gives_the_binomial_interval():
    """50 zeros and 50 ones: a resample's mean is Binomial(100, 1/2) / 100, whose 2.5% and 97.5% quantiles are
    0.40 and 0.60."""
    lo, hi = bootstrap_interval([0.0] * 50 + [1.0] * 50, resamples=20_000, seed=1)
    assert lo == pytest.approx(0.40, abs=0.011) and hi == pytest.approx(0.60, abs=0.011)


def test_bootstrap_of_a_normal_sample_matches_the_normal_interval():
    """400 draws of N(1, 0.5): the interval of the mean is about mean +- 1.96 sd / sqrt(n)."""
    rng = random.Random(7)
    values = [rng.gauss(1.0, 0.5) for _ in range(400)]
    m = sum(values) / len(values)
    sd = (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5
    half = 1.96 * sd / len(values) ** 0.5
    lo, hi = bootstrap_interval(values, seed=3)
    assert lo == pytest.approx(m - half, abs=0.1 * half) and hi == pytest.approx(m + half, abs=0.1 * half)


def test_degenerate_inputs():
    assert bootstrap_interval([1.3] * 10) == pytest.approx((1.3, 1.3))
    assert bootstrap_interval([1.3]) is None and interval_of_mean([])["mean"] is None
    assert bootstrap_ratio_interval([2, 4, 6], [1, 2, 3]) == pytest.approx((2.0, 2.0))
    with pytest.raises(ValueError, match="level=1.5"):
        bootstrap_interval([1, 2, 3], level=1.5)
    with pytest.raises(ValueError, match="3 numerators but 2 denominators"):
        bootstrap_ratio_interval([1, 2, 3], [1, 2])


def test_paired_comparison_cancels_what_the_questions_share():
    """B varies a lot from question to question and A is always 10% above it: the paired ratio is exactly 1.1 with
    no spread, A wins every question, while the two unpaired intervals overlap."""
    rng = random.Random(0)
    b = {q: rng.uniform(0.8, 3.0) for q in range(40)}
    a = {q: 1.1 * v for q, v in b.items()}
    c = paired_comparison(a, b)
    assert c["ratio"] == pytest.approx(1.1) and c["interval"] == pytest.approx([1.1, 1.1])
    assert c["wins"] == 40 and c["losses"] == 0 and c["questions"] == 40 and verdict(c) == "A ahead"
    lo_a, _ = bootstrap_interval(list(a.values()))
    _, hi_b = bootstrap_interval(list(b.values()))
    assert lo_a < hi_b
    assert verdict(paired_comparison(b, a)) == "B ahead"
    only_shared = paired_comparison({**a, 99: 5.0}, b)
    assert only_shared["questions"] == 40


def _records(method, times, tokens=100, accept=1):
    return [TurnRecord(q, "writing" if q < 5 else "math", 1, method, 0, 0.0, tokens, t, tokens // accept,
                       [accept] * (tokens // accept), 0.05, []) for q, t in enumerate(times)]


def test_method_summary_carries_per_question_figures_and_intervals():
    rng = random.Random(2)
    base_t = [rng.uniform(2.0, 3.0) for _ in range(10)]
    base = _records("baseline", base_t)
    fast = _records("m", [t / rng.uniform(1.1, 1.5) for t in base_t], accept=2)
    s = summarize_method([fast], [base])
    iv = s["intervals"]
    assert iv["questions"] == 10 and len(s["per_question"]) == 10
    assert iv["speedup"]["value"] == pytest.approx(speedup(fast, base))          # the headline, Spec-Bench's
    assert iv["speedup"]["ci"][0] < iv["speedup"]["value"] < iv["speedup"]["ci"][1]
    assert 1.1 <= iv["mean_of_ratios"]["value"] <= 1.5
    assert iv["pooled"]["value"] == pytest.approx(sum(base_t) / sum(r.wall_time for r in fast))   # same tokens
    assert iv["accept_length"]["value"] == 2.0 and iv["accept_length"]["ci"] == pytest.approx([2.0, 2.0])


def _summary():
    """A run where Hydra is 1.2x Medusa-1 on every question, Medusa-2 0.9x of it, and the 63-node tree slower."""
    rng = random.Random(5)
    base = [rng.uniform(2.0, 3.0) for _ in range(16)]
    factors = {"medusa1-optimal": 1.2, "medusa2-optimal": 1.08, "hydra-optimal": 1.44, "hydra_pp-optimal": 1.44,
               "pld": 1.3, "medusa1-sparse64": 0.6, "medusa1-chain4": 1.1, "hydra-sparse64": 0.7}
    accept = {"medusa1-sparse64": 2, "hydra-sparse64": 3, "medusa1-chain4": 1, "hydra-optimal": 2, "hydra_pp-optimal": 2,
              "medusa1-optimal": 1, "medusa2-optimal": 1, "pld": 1}
    methods = {}
    for name, f in factors.items():
        kind = "pld" if name == "pld" else "heads"
        heads, _, tree = name.partition("-")
        recs = _records(name, [t / (f * rng.uniform(0.98, 1.02)) for t in base], accept=accept[name])
        methods[name] = {"kind": kind, "heads": heads if kind == "heads" else None, "tree": tree or None,
                         **summarize_method([recs], [_records("baseline", base)])}
    return {"model": "tiny", "hardware": "2-core CPU", "lossless": True, "methods": methods,
            "settings": {"num_questions": 16, "turns": 1, "max_new_tokens": 100, "repeats": 1, "temperature_mode": "greedy"}}


def test_claims_are_judged_by_paired_intervals():
    summary = _summary()
    rows = {r["claim"]: r for r in claim_rows(summary, latency={"sizes": [1, 4, 64], "forward_lm_head_s": [1, 1.1, 3.2]})}
    assert rows["Medusa-1 speeds decoding up"]["verdict"] == "reproduced"
    assert rows["Hydra beats Medusa in speed"]["verdict"] == "reproduced"
    assert rows["Hydra beats Medusa in accepted length"]["verdict"] == "reproduced"
    assert rows["Medusa-2 beats Medusa-1"]["verdict"] == "reversed"
    assert rows["Hydra++ beats Hydra"]["verdict"] == "not reproduced"
    assert rows["Hydra++ is 1.31x Medusa"]["verdict"] == "smaller here"     # 1.2x, clearly below 1.31
    tree = rows["The 63-node tree beats a chain"]
    assert tree["verdict"] == "reversed" and "3.2x a 1-token step" in tree["reason"] and "2.00x the tokens" in tree["reason"]
    c = compare(summary, "hydra-optimal", "medusa1-optimal")
    assert c["ratio"] == pytest.approx(1.2, abs=0.02) and c["wins"] >= 14


def _eagle_run(family: str, factor: float, accept: int, seed: int) -> dict:
    """A run of one method as its metrics file holds it: <family>-optimal, pld (the stronger) and pld_hf."""
    rng = random.Random(seed)
    base = [rng.uniform(2.0, 3.0) for _ in range(16)]
    methods = {}
    for name, (f, acc) in {f"{family}-optimal": (factor, accept), "pld": (1.2, 1), "pld_hf": (1.0, 1)}.items():
        recs = _records(name, [t / (f * rng.uniform(0.98, 1.02)) for t in base], accept=acc)
        methods[name] = summarize_method([recs], [_records("baseline", base)])
    return {"tag": f"{family}-optimal_pld", "strongest_pld": {"method": "pld", "speedup": 1.2}, "methods": methods}


def test_eagle_claims_are_judged_on_each_familys_own_run():
    """EAGLE's and EAGLE-3's runs of their own (<family>-optimal_pld with <family>-optimal): each alone against
    its run's stronger prompt lookup, paired within the run; EAGLE-3's accepted length against the main run's
    Medusa-1 on the same questions."""
    summary = _summary()
    runs = {"eagle3-optimal_pld": _eagle_run("eagle3", 0.9, 3, 7), "eagle-optimal_pld": _eagle_run("eagle", 1.5, 2, 8)}
    rows = {r["claim"]: r for r in claim_rows(summary, single_runs=runs)}
    e3 = rows["EAGLE-3 beats prompt lookup"]
    assert e3["verdict"] == "reversed" and "eagle3-optimal / pld" in e3["ours"] and "accepted length 3.00x" in e3["reason"]
    e1 = rows["EAGLE beats prompt lookup"]
    assert e1["verdict"] == "reproduced" and "eagle-optimal / pld, run eagle-optimal_pld" in e1["ours"]
    acc = rows["EAGLE-3 accepts more than Medusa"]
    assert acc["verdict"] == "reproduced" and "3.00x" in acc["ours"]       # 3 tokens a step against Medusa-1's 1
    claims = {r["claim"] for r in claim_rows(summary, single_runs={"eagle3-optimal_pld": runs["eagle3-optimal_pld"]})}
    assert "EAGLE beats prompt lookup" not in claims and "EAGLE-3 beats prompt lookup" in claims   # no run, no row
    without_alone = dict(runs["eagle-optimal_pld"], methods={k: v for k, v in runs["eagle-optimal_pld"]["methods"].items()
                                                             if k != "eagle-optimal"})
    assert "EAGLE beats prompt lookup" not in {r["claim"] for r in claim_rows(summary, single_runs={
        "eagle-optimal_pld": without_alone})}                               # a run without the tree alone: no row


def test_results_document_has_every_section():
    summary = _summary()
    train = {"medusa2": {"val_top1_head0_by_epoch": {"stage1": [0.30, 0.33], "stage2": [0.34]}, "recipe": {},
                         "joint_curve": [{"positions": 5000, "step": 20, "val_top1_head0": 0.32}],
                         "val_answer_perplexity_base": 2.0, "val_answer_perplexity_adapted": 1.9},
             "medusa1": {"val_top1": {"head0": 0.35}}}
    text = results_markdown(summary, train)
    for heading in ("## Headline figures", "## Paired comparisons", "## The papers' claims", "per MT-Bench category",
                    "## Medusa-2: the joint stage"):
        assert heading in text
    assert "the joint stage raised it" in text and "| 5,000 |" in text
    assert any(r["question"].startswith("Hydra beats Medusa-1 (speed") for r in standard_comparisons(summary))


def test_results_document_opens_with_the_run_from_the_stage_metrics():
    summary = _summary()
    run = {"prepare": {"records_read": 1000, "kept": 900, "train": 850, "val": 50, "wall_time_s": 61.0},
           "distill": {"train": {"answer_positions": 5000, "conversations": 40, "self": {"answer_positions": 4000},
                                 "relabel": {"answer_positions": 1000}}, "wall_time_s": 600.0},
           "train_hydra": {"val_top1": {"head0": 0.43, "head1": 0.39}, "epochs": 2, "best_epoch": {"fit": 2},
                           "train_positions_per_s": {"fit": 1067.1}, "wall_time_s": 351.7},
           "train_medusa2": {"val_top1": {"head0": 0.30, "head1": 0.19}, "epochs": 3,
                             "best_epoch": {"stage1": 2, "stage2": 1}, "steps": {"stage1": 1404, "stage2": 58},
                             "train_positions_per_s": {"stage1": 1686.6, "stage2": 72.9}, "wall_time_s": 546.8}}
    text = results_markdown(summary, {}, run=run)
    assert text.index("## The run") < text.index("## Headline figures")
    assert "1,000 records read, 900 conversations kept (850 train, 50 val)" in text
    assert "5,000 answer positions (self 4,000, relabel 1,000) in 40 conversations" in text
    # the papers' order (Medusa-2 before Hydra), whatever order the files came in
    assert text.index("| Medusa-2 | 0.300 | 0.190 | 3 (1,404 heads-only steps, 58 joint)") < text.index("| Hydra | 0.430")
    assert "| prepare | 1 min 01 s |" in text and "| distill | 10 min 00 s |" in text
    assert "| train@hydra | 5 min 52 s |" in text
    assert "## The run" not in results_markdown(summary, {})


def test_a_run_of_its_own_is_paired_by_question_with_the_main_run():
    """Medusa-2 evaluated on its own (heads retrained after the main run): its per-question figures in the run's
    metrics pair with the main run's Medusa-1 question by question, in the claims table and the Medusa-2 section."""
    from models.measure.stage_metrics import metrics_of

    summary = _summary()
    rng = random.Random(7)
    base = [rng.uniform(2.0, 3.0) for _ in range(16)]
    own_recs = _records("medusa2-optimal", [t / (1.5 * rng.uniform(0.98, 1.02)) for t in base], accept=2)
    own_summary = {"tag": "medusa2-optimal", "settings": {"num_questions": 16, "max_new_tokens": 100},
                   "methods": {"baseline": {"kind": "baseline", **summarize_method([_records("baseline", base)],
                                                                                  [_records("baseline", base)])},
                               "medusa2-optimal": {"kind": "heads", **summarize_method([own_recs],
                                                                                      [_records("baseline", base)])}}}
    own = metrics_of(own_summary, {"passed": True, "methods": {}}, per_question=True)
    assert len(own["methods"]["medusa2-optimal"]["per_question"]) == 16
    assert "per_question" not in metrics_of(own_summary, {"passed": True, "methods": {}})["methods"]["medusa2-optimal"]
    rows = {r["claim"]: r for r in claim_rows(summary, single_runs={"medusa2-optimal": own})}
    row = rows["Medusa-2 beats Medusa-1"]                     # 1.5x against Medusa-1's 1.2x, on all 16 questions
    assert row["verdict"] == "reproduced" and "run medusa2-optimal" in row["ours"] and "of 16" in row["ours"]
    assert row["ours"].startswith("1.25x")
    within = {r["claim"]: r for r in claim_rows(summary)}["Medusa-2 beats Medusa-1"]
    assert within["verdict"] == "reversed"                    # the main run's own Medusa-2 (0.9x) where there is none
    text = results_markdown(summary, {"medusa2": {"val_top1_head0_by_epoch": {"stage1": [0.3], "stage2": [0.31]},
                                                  "recipe": {}}}, single_runs={"medusa2-optimal": own})
    assert "Medusa-2 in a run of its own (`medusa2-optimal`, 16 questions)" in text
    assert "accepted length 2.00x (2.00 to 2.00), ahead on 16 of 16" in text


def test_step_cost_is_pooled_decode_time_per_step_over_the_baselines_time_per_token():
    summary = _summary()
    rows = {r["method"]: r for r in step_cost_rows(summary)}
    # hydra-sparse64 emits 3 tokens a step at about 0.7x the baseline's speed: a step costs about 3 / 0.7 baseline steps
    hydra = rows["hydra-sparse64"]
    assert hydra["tokens_per_step"] == pytest.approx(3, abs=0.05) and hydra["step_cost"] == pytest.approx(3 / 0.7, rel=0.05)
    assert all(r["decode_speedup"] == pytest.approx(r["tokens_per_step"] / r["step_cost"]) for r in rows.values())
    assert rows["pld"]["step_cost"] == pytest.approx(1 / 1.3, rel=0.05)
    assert "## Where the speedup comes from" in results_markdown(summary, {})


def test_the_draft_model_claim_is_judged_on_its_own_runs_interval():
    def run(lo, hi):
        return {"tag": "sps-optimal", "methods": {
            "sps-optimal": {"speedup": (lo + hi) / 2, "speedup_ci": [lo, hi], "accept_length": 1.4, "questions": 80},
            "sps_hf": {"speedup": 0.65, "speedup_ci": [0.63, 0.67], "accept_length": 1.3, "questions": 80}}}
    summary = _summary()
    rows = {r["claim"]: r for r in claim_rows(summary, single_runs={"sps-optimal": run(0.89, 0.95)})}
    sps = rows["A draft model (SpS) speeds decoding up"]
    assert sps["verdict"] == "reversed" and "0.92x (0.89 to 0.95)" in sps["ours"]
    assert "assisted generation with the same draft model 0.65x (0.63 to 0.67)" in sps["reason"]
    rows = {r["claim"]: r for r in claim_rows(summary, single_runs={"sps-optimal": run(1.1, 1.3)})}
    assert rows["A draft model (SpS) speeds decoding up"]["verdict"] == "reproduced"
    assert "A draft model (SpS) speeds decoding up" not in {r["claim"] for r in claim_rows(summary)}


def test_claims_of_the_chains_merged_runs_are_judged_from_the_summary():
    """The DVC chains' runs merged into one summary (analysis/merge.py), each method over its own run's baseline:
    the EAGLE and draft-model claims come from the summary itself, paired by question with the stronger prompt
    lookup of the references run."""
    summary = _summary()
    for family, factor, accept, seed in (("eagle", 1.5, 2, 8), ("sps", 0.9, 1, 9)):
        m = _eagle_run(family, factor, accept, seed)["methods"][f"{family}-optimal"]
        summary["methods"][f"{family}-optimal"] = {"kind": "heads", "heads": family, "tree": "optimal", "run": family, **m}
    rows = {r["claim"]: r for r in claim_rows(summary)}
    eagle = rows["EAGLE beats prompt lookup"]
    assert eagle["verdict"] == "reproduced" and "eagle-optimal / pld, run eagle" in eagle["ours"]
    sps = rows["A draft model (SpS) speeds decoding up"]
    assert sps["verdict"] == "reversed" and "16 questions, run sps" in sps["ours"]


def test_dsparks_confidence_cut_is_paired_against_the_same_tree_uncut():
    """The cut accepts fewer tokens a step (it drafts fewer) but runs faster: both rows, paired over the questions
    both ran."""
    rng = random.Random(11)
    base = [rng.uniform(2.0, 3.0) for _ in range(12)]
    methods = {}
    for name, (f, acc) in {"dspark-cut": (1.5, 2), "dspark-uncut": (1.2, 4)}.items():
        recs = _records(name, [t / (f * rng.uniform(0.98, 1.02)) for t in base], accept=acc)
        methods[name] = {"kind": "heads", "heads": "dspark", "tree": name.split("-")[1],
                         **summarize_method([recs], [_records("baseline", base)])}
    rows = {r["question"]: r for r in standard_comparisons({"methods": methods})}
    speed = rows["DSpark: cutting the 16-node tree per step beats the same tree uncut (speed)"]
    accepted = rows["DSpark: cutting the 16-node tree per step beats the same tree uncut (accepted length)"]
    assert speed["ratio"] == pytest.approx(1.25, abs=0.03) and speed["wins"] == 12 and speed["questions"] == 12
    assert accepted["ratio"] == pytest.approx(0.5) and accepted["wins"] == 0
