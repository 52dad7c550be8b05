"""The cost preview (`make cost`): its arithmetic on a tiny profile, worked by hand, and the command on the real
configs with a stated machine (no measuring, so it runs in a second)."""
from __future__ import annotations

import json

import pytest

from analysis.cost_model import BUDGET_WEIGHT_READS, Plan, project, projection_table, rate_for, rates_from_run, \
    stage_work
from pipelines import cost


def tiny_params(**eval_over) -> dict:
    ev = {"num_questions": 4, "turns": 1, "repeats": 1, "max_new_tokens": 10, "trees": ["a", "b", "c"],
          "tree_questions": {"c": 2}, "families": ["h1"], "batch_sizes": [1, 2, 4], **eval_over}
    return {"pipeline_heads": ["h1", "h2"],
            "eval": {"prompt_lookup": {"enabled": True}, "drafters": {}, "hf_generate": {"enabled": True}},
            "profile": {"prepare": {"max_conversations": 100},
                        "distill": {"num_conversations": 10, "val_conversations": 2, "max_new_tokens": 8,
                                    "relabel_positions": 50},
                        "calibrate": {"latency_sizes": [1, 4], "latency_repeats": 3, "batch_sizes": [1, 2],
                                      "budgets": [4, 8], "grown": {"depth": [1, 2], "top_k": [2], "nodes": [4, 8, 16]}},
                        "eval": ev}}


def test_the_work_of_a_tiny_profile_by_hand():
    plan = Plan.from_params(tiny_params(), epochs={"h1": 2, "h2": 3}, eval_extra={"h1": 1})
    work = {s: amount for s, (_, amount) in stage_work(plan).items()}
    assert work["prepare"] == 100
    assert work["distill"] == 10 * 8 + 2 * 50                       # answers x tokens + 2 tokens a relabelled position
    positions = (10 - 2) * 8 + 50
    assert work["train@h1"] == positions * 2 and work["train@h2"] == positions * 3
    assert work["calibrate_latency"] == 2 * (3 + 1) * (1 + 1)       # sizes x (repeats + warm-up) x (batch 1, B = 2)
    assert work["calibrate@h1"] == 2 + 2 + 2 * 1 * 3                # budgets, the two fixed trees, the grown grid
    assert work["references"] == 4 * 4 * 10                         # baseline, pld, pld_hf, hf_generate
    # baseline + trees a, b on every question + the extra answer (4 questions each), tree c on 2 questions
    assert work["evaluate@h1"] == ((1 + 2 + 1) * 4 + 2) * 10
    assert "evaluate@h2" not in work                                # not in profile.eval.families
    assert work["batch_baseline"] == 2 * 4 * 10                     # B = 2 and 4
    assert work["batch@h1"] == (2 + 2) * 4 * 10                     # alone and with prompt lookup, each at 2 and 4
    assert list(work)[-1] == "tables"


def test_the_calibrated_kind_not_chosen_runs_on_fewer_questions_but_for_the_families_that_keep_both():
    over = {"trees": ["s", "opt", "opt_pld", "dyn", "dyn_pld"], "tree_questions": {"s": 2}, "families": ["h1", "h2"],
            "choice_trees": {"opt": "fixed", "opt_pld": "fixed", "dyn": "grown", "dyn_pld": "grown"},
            "unchosen_questions": 3, "both_choices": ["h2"]}
    plan = Plan.from_params(tiny_params(**over), epochs={"h1": 1, "h2": 1})
    work = {s: a for s, (_, a) in stage_work(plan).items()}
    assert work["evaluate@h1"] == ((1 + 2) * 4 + 2 + 2 * 3) * 10    # baseline + one kind on 4; s on 2, other kind on 3
    assert work["evaluate@h2"] == ((1 + 4) * 4 + 2) * 10            # both kinds on every question


def test_a_familys_own_trees_count_for_that_family_only():
    over = {"families": ["h1", "h2"], "tree_questions": {"c": 2, "cut": 3, "uncut": 3},
            "family_trees": {"h2": ["cut", "uncut", "whole", "a"]}}     # "a" is already a tree of every family
    plan = Plan.from_params(tiny_params(**over), epochs={"h1": 1, "h2": 1})
    work = {s: a for s, (_, a) in stage_work(plan).items()}
    assert work["evaluate@h1"] == ((1 + 2) * 4 + 2) * 10            # baseline, a and b on 4; c on 2
    assert work["evaluate@h2"] == ((1 + 2 + 1) * 4 + 2 + 3 + 3) * 10   # and whole on 4, cut and uncut on 3 each


def test_prompt_lookup_at_fewer_batch_sizes_counts_fewer_batches():
    plan = Plan.from_params(tiny_params(batch_lookup_sizes=[4]), epochs={"h1": 1, "h2": 1})
    assert dict((s, a) for s, (_, a) in stage_work(plan).items())["batch@h1"] == (2 + 1) * 4 * 10



def test_the_batch_curve_on_a_subset_counts_its_questions_only():
    plan = Plan.from_params(tiny_params(batch_questions=2), epochs={"h1": 1, "h2": 1})
    work = dict((s, a) for s, (_, a) in stage_work(plan).items())
    assert work["batch_baseline"] == 2 * 2 * 10                     # B = 2 and 4, on 2 of the 4 questions
    assert work["batch@h1"] == (2 + 2) * 2 * 10
    assert work["references"] == Plan.from_params(tiny_params(), epochs={"h1": 1, "h2": 1}).reference_methods * 4 * 10

def test_rates_project_through_plain_steps_into_weight_reads():
    plan = Plan.from_params(tiny_params(), epochs={"h1": 2, "h2": 3})
    work = stage_work(plan)
    # a run whose plain step was 50 ms: references took 8 s for 160 tokens -> 1 plain step a token
    rates = {s: {"plain_steps_per_unit": r, "source": "measured"}
             for s, r in rates_from_run({"references": 8.0, "train@h1": 4.0}, work, 0.05).items()}
    assert rates["references"]["plain_steps_per_unit"] == pytest.approx(1.0)
    assert rate_for("train@h2", rates)["plain_steps_per_unit"] == rates["train@h1"]["plain_steps_per_unit"]
    rows = {r.stage: r for r in project(work, rates, plain_step_s=0.1, weight_read_s=0.025)}
    ref = rows["references"]
    assert ref.plain_steps == pytest.approx(160) and ref.seconds == pytest.approx(16)
    assert ref.weight_reads == pytest.approx(640)                  # 16 s / 25 ms
    assert rows["prepare"].seconds is None and rows["prepare"].source == "no rate"
    text = projection_table(list(rows.values()), budget=1000)
    assert "| references | new tokens decoded | 160 | 160 | 640 | 0.3 | measured |" in text
    assert "Not counted (no rate): prepare, distill" in text
    assert "over the budget of 1,000 weight reads" in text          # 640 + train's reads exceed it


def test_the_preview_of_the_default_and_the_smoke_profile(tmp_path):
    machine = {"plain_step_s": 0.1, "weight_read_s": 0.04}
    full, smoke = cost.preview([], machine=machine), cost.preview(["profile=smoke"], machine=machine)
    assert "profile cpu" in full and "profile smoke" in smoke
    for text in (full, smoke):
        assert "| tables | run | 1 |" in text and f"budget of {BUDGET_WEIGHT_READS:,}" in text
        assert "Not counted" not in text                             # every stage has a rate, measured or borrowed
    assert "| evaluate@dflash |" in full and "| evaluate@dflash |" not in smoke   # smoke evaluates two families

    def minutes(text):
        return float(text.split("| all |")[1].split("|")[4].replace(",", ""))
    assert minutes(smoke) < minutes(full) / 20


def test_an_unknown_override_is_refused_by_name():
    with pytest.raises(Exception, match="profile"):
        cost.preview(["profile=nope"], machine={"plain_step_s": 0.1, "weight_read_s": 0.04})


def test_the_rates_file_names_its_run_and_every_stage_of_the_default_run():
    rates = json.loads(cost.RATES_FILE.read_text())
    assert rates["source"]["commit"] and rates["source"]["plain_step_s"] > 0
    plan = cost.plan_for(cost.compose([]))
    missing = [s for s in stage_work(plan) if rate_for(s, rates["rates"]) is None]
    assert missing == []


def test_a_train_stage_goes_through_the_train_step_where_its_rate_counts_one():
    work = {"train@h1": ("training positions x epochs", 1000.0), "references": ("new tokens decoded", 100.0)}
    rates = {"train@h1": {"plain_steps_per_unit": 0.1, "train_steps_per_unit": 0.01, "source": "measured"},
             "references": {"plain_steps_per_unit": 1.0, "train_steps_per_unit": 5.0, "source": "measured"}}
    rows = {r.stage: r for r in project(work, rates, plain_step_s=0.05, weight_read_s=0.025, train_step_s=2.0)}
    assert rows["train@h1"].seconds == pytest.approx(1000 * 0.01 * 2.0)        # 10 train steps of 2 s
    assert rows["train@h1"].plain_steps == pytest.approx(20 / 0.05)
    assert rows["train@h1"].source.endswith("through the train step")
    assert rows["references"].seconds == pytest.approx(100 * 1.0 * 0.05)      # decoding keeps the plain step
    # a machine that did not measure its train step: the plain step carries training too
    rows = {r.stage: r for r in project(work, rates, plain_step_s=0.05, weight_read_s=0.025)}
    assert rows["train@h1"].seconds == pytest.approx(1000 * 0.1 * 0.05)
    # a borrowed rate keeps the train step only where every rate of its kind has one
    assert rate_for("train@h2", rates)["train_steps_per_unit"] == 0.01
    assert "train_steps_per_unit" not in rate_for("train@h3", {**rates, "train@h2": {"plain_steps_per_unit": 0.2}})


def test_rates_from_a_run_in_progress_replace_only_the_stages_its_commits_ran(tmp_path):
    params = cost.REPO_ROOT / "params.yaml"
    work = stage_work(cost.plan_for(cost.OmegaConf.create(cost.yaml.safe_load(params.read_text()))))
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    run = {"commit": "abc1234def", "cpu": "Test CPU", "cpu_flags": []}
    (metrics / "calibrate_latency.json").write_text(json.dumps(
        {"baseline_step_s": 0.04, "weight_read": {"seconds": 0.02}, "train_step": {"seconds": 0.5},
         "run": {**run, "wall_time_s": 80.0}}))
    (metrics / "train_medusa1.json").write_text(json.dumps({"run": {**run, "wall_time_s": 400.0}}))
    (metrics / "evaluate_medusa1.json").write_text(json.dumps({"run": {"commit": "0ld0000", "wall_time_s": 9.0}}))
    old = tmp_path / "rates.json"
    old.write_text(json.dumps({"source": {"commit": "0ld0000", "plain_step_s": 0.1},
                               "rates": {"evaluate@medusa1": {"plain_steps_per_unit": 0.7, "source": "measured at 0ld0000"},
                                         "references": {"plain_steps_per_unit": 0.9, "source": "measured at 0ld0000"}}}))
    rec = cost.write_rates(params, metrics, out=old, commits=["abc1234"])
    r = rec["rates"]
    assert r["evaluate@medusa1"]["plain_steps_per_unit"] == 0.7 and r["references"]["plain_steps_per_unit"] == 0.9
    amount = work["train@medusa1"][1]
    assert r["train@medusa1"]["plain_steps_per_unit"] == pytest.approx(400 / 0.04 / amount)
    assert r["train@medusa1"]["train_steps_per_unit"] == pytest.approx(400 / 0.5 / amount)
    assert "Test CPU" in r["train@medusa1"]["source"] and "train_steps_per_unit" not in r["calibrate_latency"]
    assert rec["source"]["commit"] == "0ld0000" and rec["source"]["updated_from"]["commits"] == ["abc1234"]
