"""MT-Bench evaluation: metrics math, prompt lookup counting, and the stage end to end on a tiny model."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from models.base import build_tiny_model
from models.engine.decoding import generate
from models.measure.benchmark import TurnRecord, first_difference, speedup, speedup_on_questions_of, summarize_method
from models.measure.mtbench import chat_input_ids, load_questions, rotated, spread
from models.measure.peers import prompt_lookup_generate
from models.shared import HeadsConfig
from models.methods import build_heads
from pipelines.common import CONF_DIR
from tests.fields import without


def rec(qid, cat, turn, tokens, time, accept, method="m", prefill=0.0):
    return TurnRecord(qid, cat, turn, method, 0, 0.0, tokens, time, len(accept), accept, prefill)


def test_load_questions_balances_categories(tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": ["writing", "math"][i % 2], "turns": [f"q{i}", f"f{i}"]} for i in range(10)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert len(load_questions(path)) == 10
    picked = load_questions(path, num_questions=3)
    assert [q.question_id for q in picked] == [0, 1, 2] and {q.category for q in picked} == {"writing", "math"}
    with pytest.raises(ValueError, match="num_questions"):
        load_questions(path, num_questions=0)


def test_speedup_is_mean_question_throughput_ratio():
    base = [rec(1, "math", 1, 10, 1.0, [1] * 10), rec(1, "math", 2, 10, 1.0, [1] * 10), rec(2, "writing", 1, 20, 1.0, [1] * 20)]
    meth = [rec(1, "math", 1, 10, 0.5, [2] * 5), rec(1, "math", 2, 10, 0.5, [3, 3, 4]), rec(2, "writing", 1, 20, 0.5, [2] * 10)]
    # per-question throughput: base 10 and 20 tok/s, method 20 and 40 tok/s -> 30 / 15
    assert speedup(meth, base) == pytest.approx(2.0)
    s = summarize_method([meth, meth], [base, base])
    assert s["speedup"]["mean"] == pytest.approx(2.0) and s["speedup"]["std"] == pytest.approx(0.0)
    assert s["accept_length"]["mean"] == pytest.approx(40 / 18)
    assert s["per_category"]["math"]["speedup"]["mean"] == pytest.approx(2.0)
    assert s["accept_length_histogram"] == {"2": 30, "3": 4, "4": 2}
    assert list(s["per_category"]) == ["writing", "math"]            # MT-Bench's category order


def test_decode_only_speedup_takes_the_prefill_out():
    # question 1: baseline 33 tokens in 0.5 s prefill + 2 s decode (16 tok/s decoding), method 0.5 + 1 s (32 tok/s)
    # question 2: baseline 65 tokens in 1 + 8 s (8 tok/s), method 1 + 2 s (32 tok/s)
    base = [rec(1, "math", 1, 33, 2.5, [1] * 32, prefill=0.5), rec(2, "writing", 1, 65, 9.0, [1] * 64, prefill=1.0)]
    meth = [rec(1, "math", 1, 33, 1.5, [4] * 8, prefill=0.5), rec(2, "writing", 1, 65, 3.0, [4] * 16, prefill=1.0)]
    assert speedup(meth, base, decode_only=True) == pytest.approx(32.0 / 12.0)      # mean(32, 32) / mean(16, 8)
    assert speedup(meth, base) == pytest.approx((33 / 1.5 + 65 / 3.0) / (33 / 2.5 + 65 / 9.0))
    assert speedup(meth, base, decode_only=True) > speedup(meth, base)          # the shared prefill dilutes it
    s = summarize_method([meth], [base])
    assert s["decode_speedup"]["mean"] == pytest.approx(32.0 / 12.0) and s["questions"] == 2
    assert s["decode_throughput"]["mean"] == pytest.approx(32.0) and s["prefill_time"] == pytest.approx(1.5)
    assert s["per_category"]["writing"]["decode_speedup"]["mean"] == pytest.approx(4.0)
    # a one-token answer has nothing to decode: that question drops out of the decode-only mean only
    one = [rec(3, "stem", 1, 1, 0.3, [], prefill=0.3)]
    assert speedup(meth + one, base + one, decode_only=True) == pytest.approx(32.0 / 12.0)
    assert speedup(meth + one, base + one) != pytest.approx(speedup(meth, base))
    assert TurnRecord.as_dict(meth[0])["decode_time"] == pytest.approx(1.0)


def test_subsets_spread_over_the_list_and_are_compared_on_their_questions():
    assert spread(list(range(8)), 4) == [0, 2, 4, 6] and spread(list(range(16)), 4) == [0, 4, 8, 12]
    assert spread([1, 2, 3], None) == [1, 2, 3] and spread([1, 2, 3], 5) == [1, 2, 3]
    with pytest.raises(ValueError, match="n >= 1"):
        spread([1, 2], 0)
    base = [rec(1, "math", 1, 10, 1.0, [1] * 9), rec(2, "writing", 1, 10, 1.0, [1] * 9)]
    pld = [rec(1, "math", 1, 10, 0.5, [2] * 4), rec(2, "writing", 1, 10, 2.0, [1] * 9)]
    subset_method = [rec(1, "math", 1, 10, 0.8, [1] * 9)]                        # ran on question 1 only
    assert speedup(pld, base) == pytest.approx(25 / 20)
    assert speedup_on_questions_of([pld], [base], [subset_method]) == pytest.approx(2.0)


def test_first_difference_and_rotation():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2
    assert rotated(["a", "b", "c"], 4) == ["b", "c", "a"]


def test_prompt_lookup_counts_steps_and_matches_greedy():
    model, tok = build_tiny_model(seed=1)
    ids = chat_input_ids(tok, ["abcabcabcabc"], [])
    out = prompt_lookup_generate(model, ids, max_new_tokens=24, stop_token_ids=[tok.eos_token_id],
                                 pad_token_id=tok.pad_token_id)
    ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=[tok.eos_token_id],
                         pad_token_id=tok.pad_token_id, temperature=None, top_p=None, top_k=None)[0, len(ids):].tolist()
    if tok.eos_token_id in ref:
        ref = ref[:ref.index(tok.eos_token_id) + 1]
    assert out.new_tokens == ref
    # the prefill emits the first token; every later forward call emits accept_lengths[j] >= 1 tokens
    assert sum(out.accept_lengths) == len(out.new_tokens) - 1 and min(out.accept_lengths) >= 1
    assert out.steps == len(out.accept_lengths)
    assert 0 < out.prefill_time < out.wall_time                   # the end of the first forward call


def test_prompt_lookup_reference_counts_drafts_accepted_in_the_prefill_call():
    """A prompt ending in the model's own repeating answer: transformers accepts drafts in its very first
    forward (prompt + lookup); they form a step of their own, and every token is counted once."""
    model, tok = build_tiny_model(arch="llama", seed=3)
    ids = chat_input_ids(tok, ["x" * 200], [])
    with torch.inference_mode():
        ids += generate(model, tok, ids, max_new_tokens=40, stop_token_ids=[]).new_tokens   # ends in 94 94 94 ...
        out = prompt_lookup_generate(model, ids, max_new_tokens=24, num_tokens=10, stop_token_ids=[],
                                     pad_token_id=tok.pad_token_id)
        ref = generate(model, tok, ids, max_new_tokens=24, stop_token_ids=[])
    assert out.new_tokens == ref.new_tokens
    assert out.accept_lengths[0] > 1                      # drafts accepted in the prefill call: the case under test
    assert max(out.accept_lengths) <= 10 + 1              # no step emits more than one lookup's drafts + 1
    assert sum(out.accept_lengths) == len(out.new_tokens) - 1 and out.steps == len(out.accept_lengths)


# -- the stage end to end on a tiny model ---------------------------------------------------------
QUESTIONS = [{"question_id": 1, "category": "writing", "turns": ["Write a haiku about the sea.", "Now one about hills."]},
             {"question_id": 2, "category": "math", "turns": ["What is 12 * 7?", "And 12 * 8?"]}]


@pytest.fixture
def stage_cfg(tmp_path, monkeypatch):
    """The real config composed for a tiny model, 2 questions x 2 turns, 2 random-head families x 2 trees
    (sparse64 on the first question only)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")     # a throwaway store, fast to create
    qfile = tmp_path / "questions.jsonl"
    qfile.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    model, _ = build_tiny_model()
    for name, family in (("medusa1", "medusa"), ("hydra", "hydra")):
        cfg = HeadsConfig.for_base(model, family=family, num_heads=4, share_lm_head=True)
        torch.manual_seed(0)
        heads = build_heads(cfg, model)
        with torch.no_grad():       # random (not identity) heads: drafts are often wrong, sometimes right
            for p in heads.blocks.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        heads.save(tmp_path / "results" / "heads" / name)
    overrides = ["model=tiny_random", "profile=smoke", f"paths.results={tmp_path / 'results'}", f"paths.data={tmp_path / 'data'}",
                 f"paths.reports={tmp_path / 'reports'}", f"data.questions_file={qfile}",
                 "profile.eval.num_questions=null", "profile.eval.turns=2", "profile.eval.max_new_tokens=12",
                 "profile.eval.repeats=2", "profile.eval.warmup=1", "profile.eval.trees=[sparse64,chain4]",
                 "profile.eval.families=[medusa1,hydra]", "profile.eval.tree_questions.sparse64=1",
                 "eval.num_threads=1"]
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose(config_name="config", overrides=overrides)


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def test_evaluate_end_to_end(stage_cfg, tmp_path):
    from pipelines.evaluate import run_evaluation

    summary = run_evaluation(stage_cfg)
    out = tmp_path / "results" / "eval" / "all"
    names = {"baseline", "pld", "pld_hf", "hf_generate", "medusa1-sparse64", "medusa1-chain4", "hydra-sparse64",
             "hydra-chain4"}
    assert set(summary["methods"]) == names
    assert {p.stem for p in out.glob("*.json")} == names | {"summary", "lossless_report"}

    # schema: every turn recorded with tokens, time (prefill and decode), steps and per-step accept lengths
    hydra = read(out / "hydra-chain4.json")
    assert hydra["summary"]["kind"] == "heads" and hydra["summary"]["tree_nodes"] == 4
    assert len(hydra["runs"]) == 2 and len(hydra["runs"][0]) == 4            # 2 questions x 2 turns
    for name in ("hydra-chain4", "pld", "pld_hf", "hf_generate"):
        for r in read(out / f"{name}.json")["runs"][0]:
            assert r["new_tokens"] == 1 + sum(r["accept_lengths"]) and r["steps"] == len(r["accept_lengths"])
            assert 0 < r["prefill_time"] < r["wall_time"] and r["turn"] in (1, 2)
            assert r["decode_time"] == pytest.approx(r["wall_time"] - r["prefill_time"])
    base = read(out / "baseline.json")
    assert set(base["answers"]) == {"1", "2"} and len(base["answers"]["1"]) == 2
    assert all(a == 1 for run in base["runs"] for r in run for a in r["accept_lengths"])

    # speedups: mean per-question throughput over the same run's baseline, mean over the 2 runs
    def tput(recs, decode_only=False, questions=(1, 2)):
        per_q = {}
        for r in recs:
            t, w = per_q.get(r["question_id"], (0, 0.0))
            seconds = r["decode_time"] if decode_only else r["wall_time"]
            per_q[r["question_id"]] = (t + r["new_tokens"] - decode_only, w + seconds)
        return sum(t / w for q, (t, w) in per_q.items() if q in questions) / len(questions)
    for decode_only, key in ((False, "speedup"), (True, "decode_speedup")):
        ratios = [tput(m, decode_only) / tput(b, decode_only) for m, b in zip(hydra["runs"], base["runs"])]
        assert summary["methods"]["hydra-chain4"][key]["mean"] == pytest.approx(sum(ratios) / 2)
        assert summary["methods"]["baseline"][key]["mean"] == pytest.approx(1.0)
    assert set(summary["methods"]["pld"]["per_category"]) == {"writing", "math"}

    # sparse64 ran on question 1 only (profile.eval.tree_questions): its speedup and the PLDs' beside it too
    sparse = read(out / "hydra-sparse64.json")
    assert [{r["question_id"] for r in run} for run in sparse["runs"]] == [{1}, {1}] and len(sparse["runs"][0]) == 2
    s = summary["methods"]["hydra-sparse64"]
    assert s["questions"] == 1 and summary["methods"]["hydra-chain4"]["questions"] == 2
    ratios = [tput(m, questions=(1,)) / tput(b, questions=(1,)) for m, b in zip(sparse["runs"], base["runs"])]
    assert s["speedup"]["mean"] == pytest.approx(sum(ratios) / 2)
    pld_runs = read(out / "pld.json")["runs"]
    ratios = [tput(m, questions=(1,)) / tput(b, questions=(1,)) for m, b in zip(pld_runs, base["runs"])]
    assert s["pld_speedups"]["pld"] == pytest.approx(sum(ratios) / 2) and set(s["pld_speedups"]) == {"pld", "pld_hf"}
    assert summary["settings"]["tree_questions"] == {"sparse64": 1}

    report = read(out / "lossless_report.json")
    assert report["passed"] and not report["failures"]
    assert report["methods"]["hydra-chain4"]["checked_turns"] == 8             # 2 runs x 2 questions x 2 turns
    assert report["methods"]["hydra-sparse64"]["checked_turns"] == 4           # 2 runs x 1 question x 2 turns
    assert report["methods"]["pld"]["checked_turns"] == report["methods"]["pld_hf"]["checked_turns"] == 8
    # transformers' greedy generate, no drafting: every greedy turn the baseline's token for token
    assert report["methods"]["hf_generate"] == {"reference": "baseline", "checked_turns": 8, "identical": 8,
                                                "ties": 0, "failures": 0}
    assert all(a == 1 for run in read(out / "hf_generate.json")["runs"] for r in run for a in r["accept_lengths"])
    metrics = read(tmp_path / "reports" / "metrics" / "evaluate.json")
    assert metrics["lossless"] and set(metrics["methods"]) == names - {"baseline"}
    decode = summary["methods"]["hydra-chain4"]["decode_speedup"]["mean"]
    assert metrics["methods"]["hydra-chain4"]["decode_speedup"] == decode
    pld = {n: summary["methods"][n]["speedup"]["mean"] for n in ("pld", "pld_hf")}
    assert metrics["strongest_pld"]["method"] == max(pld, key=pld.get)
    # intervals over questions beside every figure; the headline value is the Spec-Bench speedup itself
    chain = metrics["methods"]["hydra-chain4"]
    iv = summary["methods"]["hydra-chain4"]["intervals"]
    assert set(summary["methods"]["hydra-chain4"]["per_question"]) == {"1", "2"} and iv["questions"] == 2
    assert chain["speedup_ci"][0] <= chain["speedup_ci"][1] and len(chain["accept_length_ci"]) == 2
    assert chain["speedup_pooled"]["value"] > 0 and chain["speedup_mean_of_ratios"]["value"] > 0
    assert metrics["lossless_checked_turns"] == sum(v["checked_turns"] for v in report["methods"].values())


def test_evaluate_refuses_bad_protocol_values(stage_cfg):
    from pipelines.evaluate import check_protocol

    for key, value in (("max_new_tokens", -3), ("turns", 0), ("num_questions", 0), ("repeats", 1.5)):
        cfg = stage_cfg.copy()
        cfg.profile.eval[key] = value
        with pytest.raises(ValueError, match=rf"profile.eval.{key}={value!r}"):
            check_protocol(cfg)


def test_selected_method_writes_its_own_tag(stage_cfg, tmp_path):
    from omegaconf import open_dict

    from pipelines.evaluate import run_evaluation

    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=[
            "heads=hydra", "tree=chain4", "model=tiny_random", "profile=smoke", f"paths.results={tmp_path / 'results'}",
            f"paths.data={tmp_path / 'data'}",
            f"paths.reports={tmp_path / 'reports'}", f"data.questions_file={stage_cfg.data.questions_file}",
            "profile.eval.num_questions=2", "profile.eval.max_new_tokens=8", "profile.eval.warmup=0",
            "profile.eval.turns=1", "+profile.eval.tree_questions.chain4=1", "eval.prompt_lookup.enabled=false"])
    assert cfg.eval.tag == "hydra-chain4"
    with open_dict(cfg):
        cfg.eval.num_threads = 1
    summary = run_evaluation(cfg)
    assert set(summary["methods"]) == {"baseline", "hydra-chain4", "hf_generate"}     # eval.hf_generate stays on
    assert summary["methods"]["hydra-chain4"]["questions"] == 2         # the budget cut is for the full run only
    assert (tmp_path / "results" / "eval" / "hydra-chain4" / "summary.json").is_file()
    assert (tmp_path / "reports" / "metrics" / "evaluate_hydra-chain4.json").is_file()
    assert not (tmp_path / "results" / "eval" / "all").exists()


def test_selected_trees_join_a_selected_run_under_its_tag():
    """eval.selected_trees: the selected heads also run on those trees in the same run (its own tree not twice)."""
    from pipelines.methods import selection

    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=["heads=hydra", "tree=optimal_pld",
                                                       "eval.selected_trees=[optimal,optimal_pld,chain4]"])
    sel = selection(cfg)
    assert (sel.mode, sel.tag, sel.heads, sel.trees) == ("selected", "hydra-optimal_pld", ["hydra"],
                                                        [None, "optimal", "chain4"])


def test_a_chain_runs_its_own_baseline_and_the_tables_pair_it_with_the_references(stage_cfg, tmp_path):
    """evaluate@hydra (eval.methods=heads): the baseline and hydra on every tree of profile.eval.trees, no prompt
    lookup; references: the baseline and both prompt lookups. Merged for the tables, every method keeps its speedup
    over its own run's baseline, and methods of the two runs are paired question by question through those."""
    from analysis.comparisons import compare
    from analysis.merge import merged_summary
    from pipelines.common import apply_selection
    from pipelines.evaluate import run_evaluation

    with open_dict(stage_cfg):
        stage_cfg.profile.eval.repeats = 1
        stage_cfg.profile.eval.turns = 1
        stage_cfg.select = {"heads": "hydra"}
    heads_cfg = apply_selection(stage_cfg)
    heads_cfg.eval.methods = "heads"
    ours = run_evaluation(heads_cfg)
    assert set(ours["methods"]) == {"baseline", "hydra-sparse64", "hydra-chain4"}
    refs_cfg = heads_cfg.copy()
    refs_cfg.eval.methods = "references"
    refs = run_evaluation(refs_cfg)
    assert set(refs["methods"]) == {"baseline", "pld", "pld_hf", "hf_generate"}
    metrics = tmp_path / "reports" / "metrics"
    assert set(read(metrics / "evaluate_hydra.json")["methods"]["hydra-chain4"]["per_question"]) == {"1", "2"}
    assert read(metrics / "references.json")["strongest_pld"]["method"] in ("pld", "pld_hf")

    merged = merged_summary(tmp_path / "results" / "eval", ["hydra", "medusa1"])   # medusa1 has not run: left out
    assert set(merged["methods"]) == {"baseline", "pld", "pld_hf", "hf_generate", "hydra-sparse64", "hydra-chain4"}
    assert merged["methods"]["hydra-chain4"]["run"] == "hydra" and merged["methods"]["pld"]["run"] == "references"
    assert merged["methods"]["hydra-chain4"]["speedup"] == ours["methods"]["hydra-chain4"]["speedup"]
    assert merged["settings"]["tree_questions"] == {"sparse64": 1} and merged["lossless"]
    pld_q = {q: r["speedup"] for q, r in refs["methods"]["pld"]["per_question"].items()}
    assert merged["methods"]["hydra-sparse64"]["pld_speedups"]["pld"] == pytest.approx(pld_q["1"])   # its 1 question
    hydra_q = {q: r["speedup"] for q, r in ours["methods"]["hydra-chain4"]["per_question"].items()}
    c = compare(merged, "hydra-chain4", "pld")
    assert c["questions"] == 2 and c["ratio"] == pytest.approx(sum(hydra_q.values()) / sum(pld_q.values()))
    assert c["wins"] == sum(hydra_q[q] > pld_q[q] for q in hydra_q)


def test_broken_method_fails_losslessness_naming_question_turn_position(stage_cfg, tmp_path, monkeypatch):
    import pipelines.evaluate as ev

    real = ev.generate_turn

    def broken(method, tokenizer, input_ids, *args, **kwargs):
        result = real(method, tokenizer, input_ids, *args, **kwargs)
        if method.name == "medusa1-chain4" and len(input_ids) > 60:     # only turn 2 (its prompt holds turn 1)
            result.new_tokens[3] = (result.new_tokens[3] + 1) % 200 + 3     # change one token
        return result

    monkeypatch.setattr(ev, "generate_turn", broken)
    with pytest.raises(ev.LosslessnessError) as err:
        ev.run_evaluation(stage_cfg)
    msg = str(err.value)
    assert "question 1 turn 2" in msg and "question 2 turn 2" in msg and "method medusa1-chain4" in msg
    assert "position 3" in msg and "turn 1" not in msg
    report = read(tmp_path / "results" / "eval" / "all" / "lossless_report.json")  # written before failing
    assert not report["passed"] and {f["position"] for f in report["failures"]} == {3}
    assert report["methods"]["hydra-sparse64"]["failures"] == 0
    assert (tmp_path / "results" / "eval" / "all" / "summary.json").is_file()


def test_the_cut_tree_is_the_calibrated_tree_cut_by_the_latency_profile(stage_cfg, tmp_path):
    """tree=cut: results/calibrate/<heads>/trees/budget_16.json cut per step with results/calibrate/latency.json."""
    from omegaconf import open_dict

    from pipelines.evaluate import run_evaluation

    cal = tmp_path / "results" / "calibrate"
    (cal / "hydra" / "trees").mkdir(parents=True)
    paths = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]
    (cal / "hydra" / "trees" / "budget_16.json").write_text(json.dumps({"name": "hydra_budget16", "paths": paths,
                                                                         "top_k": 10}))
    (cal / "latency.json").write_text(json.dumps({"sizes": [1, 4, 16], "forward_lm_head_s": [0.01, 0.011, 0.03],
                                                  "baseline_step_s": 0.01}))
    with open_dict(stage_cfg):
        stage_cfg.profile.eval.trees = ["cut"]
        stage_cfg.profile.eval.families = ["hydra"]
        stage_cfg.profile.eval.repeats = 1
        stage_cfg.eval.prompt_lookup.enabled = False
    summary = run_evaluation(stage_cfg)
    m = summary["methods"]["hydra-cut"]
    assert m["cut_by_cost"] is True and m["tree_nodes"] == 7 and m["tree"] == "cut"
    report = read(tmp_path / "results" / "eval" / "all" / "lossless_report.json")
    assert report["passed"] and report["methods"]["hydra-cut"]["checked_turns"] == 4


def test_lookup_trees_merge_prompt_lookup_into_the_heads_tree(stage_cfg, tmp_path):
    """tree=optimal_pld (the calibrated tree + prompt lookup's chain) and cut_pld (the 16-node tree + the chain,
    cut per step with room for the chain's tokens in the step costs): lossless, flagged in the summary."""
    from omegaconf import open_dict

    from pipelines.evaluate import run_evaluation

    cal = tmp_path / "results" / "calibrate"
    (cal / "hydra" / "trees").mkdir(parents=True)
    (cal / "hydra" / "optimal_tree.json").write_text(json.dumps({"name": "hydra_opt", "paths": [[0], [0, 0]], "top_k": 10}))
    (cal / "hydra" / "trees" / "budget_16.json").write_text(json.dumps({"name": "hydra_budget16", "top_k": 10,
                                                                         "paths": [[0], [1], [0, 0], [0, 0, 0]]}))
    (cal / "latency.json").write_text(json.dumps({"sizes": [1, 4, 16], "forward_lm_head_s": [0.01, 0.011, 0.03],
                                                  "baseline_step_s": 0.01}))
    with open_dict(stage_cfg):
        stage_cfg.profile.eval.trees = ["optimal_pld", "cut_pld"]
        stage_cfg.profile.eval.families = ["hydra"]
        stage_cfg.profile.eval.repeats = 1
    summary = run_evaluation(stage_cfg)
    opt, dyn = summary["methods"]["hydra-optimal_pld"], summary["methods"]["hydra-cut_pld"]
    assert opt["lookup_branch"] is True and opt["cut_by_cost"] is False and opt["tree_nodes"] == 2
    assert opt["tree"] == "optimal_pld"                  # named by the option, not by the calibrated file it reads
    assert dyn["lookup_branch"] is True and dyn["cut_by_cost"] is True and dyn["tree"] == "cut_pld"
    assert summary["methods"]["pld"]["lookup_branch"] is False
    fingerprint = read(tmp_path / "data" / "eval-records" / stage_cfg.model.name / "all" / "manifest.json")
    costs = {m["name"]: m["step_cost"] for m in fingerprint["settings"]["methods"]}
    assert costs["hydra-optimal_pld"] is None
    assert len(costs["hydra-cut_pld"]) == 4 + 1 + int(stage_cfg.eval.prompt_lookup.pld.num_tokens)
    report = read(tmp_path / "results" / "eval" / "all" / "lossless_report.json")
    assert report["passed"] and report["methods"]["hydra-optimal_pld"]["checked_turns"] == 4


# -- resuming: per-question records survive a killed run ------------------------------------------
class Killed(BaseException):
    """The process dying (not an Exception: nothing in the stage catches it)."""


TIMING = {"wall_time", "prefill_time", "decode_time", "speedup", "decode_speedup", "throughput", "decode_throughput",
          "pld_speedups", "speedup_std", "decode_speedup_std", "tokens_per_s", "decode_tokens_per_s",
          "baseline_tokens_per_s", "baseline_decode_tokens_per_s", "strongest_pld",
          # per-question figures and intervals: times, and what is computed from them (accepted length is not)
          "time", "base_time", "base_decode_time", "mean_of_ratios", "pooled", "speedup_ci", "decode_speedup_ci",
          "speedup_mean_of_ratios", "speedup_pooled", "per_category_speedup",
          "date", "wall_time_s", "invocations"}    # the run record (pipelines.common.run_record): when, how long


def untimed(obj):
    """obj without the fields a run measures anew (times and what is computed from them), at any depth."""
    return without(obj, TIMING)


def outputs(tmp_path: Path) -> dict:
    """Every file the stage writes: results/eval/all/*.json and reports/metrics/evaluate.json."""
    files = sorted((tmp_path / "results" / "eval" / "all").glob("*.json"))
    return {p.name: read(p) for p in files + [tmp_path / "reports" / "metrics" / "evaluate.json"]}


@pytest.fixture
def resume_cfg(stage_cfg):
    """stage_cfg with one family: baseline, hydra-sparse64 (question 1 only), hydra-chain4, pld, pld_hf;
    2 runs x 2 questions = 4 (run, question) results of 2 turns."""
    with open_dict(stage_cfg):
        stage_cfg.profile.eval.families = ["hydra"]
    return stage_cfg


class Decodes:
    """The question turns pipelines.evaluate decodes, as (run, question id, turn, method) in order; warm-up
    generations are counted apart. kill_at = n: the n-th decode (1-based) dies."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.turns, self.warmups, self.kill_at = [], 0, None


@pytest.fixture
def decodes(monkeypatch) -> Decodes:
    import pipelines.evaluate as ev

    real, seen = ev.generate_turn, Decodes()

    def counted(method, tokenizer, input_ids, cfg, temperature, seed, stop_ids, max_new=None):
        if max_new is not None:
            seen.warmups += 1
        else:   # the stage seeds turn t of question q in run r with seed + 1000 r + 10 q + t
            run, rest = divmod(seed - cfg.seed, 1000)
            seen.turns.append((run, rest // 10, rest % 10, method.name))
            if len(seen.turns) == seen.kill_at:
                raise Killed
        return real(method, tokenizer, input_ids, cfg, temperature, seed, stop_ids, max_new)
    monkeypatch.setattr(ev, "generate_turn", counted)
    return seen


def records_dir(tmp_path: Path) -> Path:
    return tmp_path / "data" / "eval-records" / "tiny-random-llama" / "all"


def test_a_killed_evaluate_resumes_where_it_stopped(resume_cfg, tmp_path, decodes, caplog):
    from pipelines.evaluate import run_evaluation

    run_evaluation(resume_cfg)                                      # uninterrupted, for reference
    full, reference = list(decodes.turns), outputs(tmp_path)
    units = sorted({(r, q) for r, q, _, _ in full})
    assert units == [(0, 1), (0, 2), (1, 1), (1, 2)]
    shutil.rmtree(tmp_path / "data")
    shutil.rmtree(tmp_path / "results" / "eval")

    # killed in run 1's first question, after its first turn's second method: two questions are done
    decodes.reset()
    decodes.kill_at = sum(u[0] == 0 for u in full) + 2
    with pytest.raises(Killed):
        run_evaluation(resume_cfg)
    assert {p.name for p in records_dir(tmp_path).glob("r*")} == {"r0-q1.json", "r0-q2.json"}
    assert not (tmp_path / "results" / "eval" / "all" / "summary.json").exists()

    # the rerun decodes run 1's questions only, in the same order, and writes what the uninterrupted run wrote
    decodes.reset()
    with caplog.at_level("INFO", logger="pipelines"):
        run_evaluation(resume_cfg)
    assert decodes.turns == [t for t in full if t[0] == 1] and decodes.warmups > 0
    assert "2 of 4 (run, question) results reused" in caplog.text
    resumed = outputs(tmp_path)
    assert set(resumed) == set(reference) and untimed(resumed) == untimed(reference)
    # the stage's time sums both invocations (pipelines.stage_clock), the uninterrupted run's is its one
    assert resumed["evaluate.json"]["run"]["invocations"] == 2 and reference["evaluate.json"]["run"]["invocations"] == 1

    # all done: nothing decoded (nor warmed up), the same files to the last figure: a function of the records (the
    # run record's date aside, which says when the stage ran)
    decodes.reset()
    run_evaluation(resume_cfg)
    again = outputs(tmp_path)
    assert decodes.turns == [] and decodes.warmups == 0 and untimed(again) == untimed(resumed)
    assert again["evaluate.json"]["run"]["invocations"] == 1     # the finished stage cleared its clock
    assert {k: v for k, v in again.items() if k != "evaluate.json"} == {k: v for k, v in resumed.items()
                                                                          if k != "evaluate.json"}

    # another setting: the stored records are not this run's, every question is decoded again
    with open_dict(resume_cfg):
        resume_cfg.eval.prompt_lookup.enabled = False
    decodes.reset()
    with caplog.at_level("WARNING", logger="pipelines"):
        run_evaluation(resume_cfg)
    assert sorted({(r, q) for r, q, _, _ in decodes.turns}) == units and "discarding" in caplog.text


def test_a_cut_off_or_incomplete_record_is_redone_and_a_temporary_file_ignored(resume_cfg, tmp_path, decodes,
                                                                                 monkeypatch, caplog):
    from pipelines.evaluate import run_evaluation

    run_evaluation(resume_cfg)
    full, reference = list(decodes.turns), outputs(tmp_path)
    folder = records_dir(tmp_path)

    # killed while writing a record, half of it on disk: the record is whole or absent, never half
    (folder / "r0-q2.json").unlink()

    def die_half_written(fd):
        os.ftruncate(fd, os.fstat(fd).st_size // 2)
        raise Killed
    decodes.reset()
    with monkeypatch.context() as patch, pytest.raises(Killed):
        patch.setattr(os, "fsync", die_half_written)
        run_evaluation(resume_cfg)
    assert {(r, q) for r, q, _, _ in decodes.turns} == {(0, 2)}
    assert not (folder / "r0-q2.json").exists() and (folder / "r0-q2.json.tmp").stat().st_size > 0

    # a record cut off (e.g. by an older non-atomic copy), one missing a method, a stray temporary file beside a
    # finished record: the first two are redone, the temporary files are never read
    text = (folder / "r1-q1.json").read_text()
    (folder / "r1-q1.json").write_text(text[:len(text) // 2])
    body = read(folder / "r0-q1.json")
    del body["records"]["pld"]
    (folder / "r0-q1.json").write_text(json.dumps(body))
    (folder / "r1-q2.json.tmp").write_text('{"not": "a record"')
    decodes.reset()
    with caplog.at_level("INFO", logger="pipelines"):
        run_evaluation(resume_cfg)
    assert decodes.turns == [t for t in full if t[:2] != (1, 2)]           # all but run 1's question 2
    assert "1 of 4 (run, question) results reused" in caplog.text
    assert "r1-q1.json is unreadable" in caplog.text and "r0-q1.json is incomplete" in caplog.text
    assert untimed(outputs(tmp_path)) == untimed(reference)


def test_the_records_fingerprint_follows_settings_questions_trees_and_heads_files(resume_cfg, tmp_path, caplog):
    import pipelines.evaluate as ev
    from pipelines.common import load_model

    def fingerprint(cfg):
        model, _ = load_model(cfg)
        sel = ev.selection(cfg)
        return ev.fingerprint(cfg, sel, ev.build_methods(cfg, model, sel), load_questions(cfg.data.questions_file),
                              "cpu")[0]

    before = fingerprint(resume_cfg)
    assert fingerprint(resume_cfg) == before
    heads = tmp_path / "results" / "heads" / "hydra" / "heads.safetensors"
    weights = heads.read_bytes()
    heads.write_bytes(weights[:-1] + bytes([weights[-1] ^ 1]))          # retrained heads: one bit of a weight
    assert fingerprint(resume_cfg) != before
    heads.write_bytes(weights)
    qfile = Path(resume_cfg.data.questions_file)
    qfile.write_text(qfile.read_text().replace("haiku", "limerick"))
    assert fingerprint(resume_cfg) != before
    for key, value in (("profile.eval.turns", 1), ("eval.rotate_order", False), ("profile.eval.trees", ["chain4"])):
        cfg = resume_cfg.copy()
        with open_dict(cfg):
            OmegaConf.update(cfg, key, value)
        assert fingerprint(cfg) != before, key
    # a recalibrated tree of the same name (cut: results/calibrate/hydra/trees/budget_16.json)
    trees = tmp_path / "results" / "calibrate" / "hydra" / "trees"
    trees.mkdir(parents=True)
    (tmp_path / "results" / "calibrate" / "latency.json").write_text(json.dumps(
        {"sizes": [1, 4, 16], "forward_lm_head_s": [0.01, 0.011, 0.03], "baseline_step_s": 0.01}))
    with open_dict(resume_cfg):
        resume_cfg.profile.eval.trees = ["cut"]
    (trees / "budget_16.json").write_text(json.dumps({"name": "b16", "paths": [[0], [1], [0, 0]], "top_k": 10}))
    cut = fingerprint(resume_cfg)
    (trees / "budget_16.json").write_text(json.dumps({"name": "b16", "paths": [[0], [0, 0], [0, 1]], "top_k": 10}))
    assert fingerprint(resume_cfg) != cut

    # a record of another fingerprint is never read: a store opened with a new one starts empty, and a
    # foreign file in it is redone
    folder, result = tmp_path / "records", ev.QuestionResult({"baseline": []}, [], [])
    ev.RecordStore(folder, "a", {}).save(0, 1, result)
    assert ev.RecordStore(folder, "a", {}).load(0, 1, ["baseline"], 0) == result
    store = ev.RecordStore(folder, "b", {})
    assert not store.path(0, 1).exists()
    ev.RecordStore(folder / "old", "a", {}).save(0, 1, result)
    (folder / "old" / "r0-q1.json").rename(store.path(0, 1))
    with caplog.at_level("WARNING", logger="pipelines"):
        assert store.load(0, 1, ["baseline"], 0) is None
    assert "another run's or settings' result" in caplog.text


def test_a_new_drafter_is_evaluated_with_one_module_and_one_config_entry(stage_cfg, monkeypatch):
    """A toy drafter (one class, one entry in DRAFTERS: tests/test_drafters.py) and one entry in eval.drafters: the
    evaluate stage runs it beside the baseline, times it like every method and checks it lossless."""
    from omegaconf import open_dict

    from models.engine.drafting import DRAFTERS
    from pipelines.evaluate import run_evaluation
    from tests.test_drafters import RepeatDrafter

    monkeypatch.setitem(DRAFTERS, "toy_repeat", lambda spec, **_: RepeatDrafter(int(spec["k"])))
    with open_dict(stage_cfg):
        stage_cfg.profile.eval.families = []
        stage_cfg.profile.eval.repeats = 1
        stage_cfg.eval.prompt_lookup.enabled = False
        stage_cfg.eval.drafters = {"repeat3": {"kind": "toy_repeat", "k": 3}}
    summary = run_evaluation(stage_cfg)
    m = summary["methods"]["repeat3"]
    assert m["kind"] == "drafter" and m["drafter"] == {"kind": "toy_repeat", "k": 3}
    assert summary["lossless"] and m["questions"] == len(QUESTIONS) and m["speedup"]["mean"] > 0
    with open_dict(stage_cfg):
        stage_cfg.eval.drafters = {"lookahead": {"kind": "lookahead"}}
    with pytest.raises(ValueError, match="drafter kind 'lookahead' is not known"):
        run_evaluation(stage_cfg)


def test_eagle_and_a_draft_model_evaluate_losslessly_beside_assisted_generation(stage_cfg, tmp_path):
    """The autoregressive families run through the stage like the heads (their folders, their trees), and a
    draft-model family brings transformers' assisted generation with the same model (sps_hf) beside it."""
    from pipelines.evaluate import run_evaluation

    model, _ = build_tiny_model()
    for name, family, layers in (("eagle", "eagle", 1), ("sps", "draft_model", 1)):
        torch.manual_seed(0)
        build_heads(HeadsConfig.for_base(model, family=family, num_heads=4, num_layers=layers, share_lm_head=True),
                    model).save(tmp_path / "results" / "heads" / name)
    with open_dict(stage_cfg):
        stage_cfg.profile.eval.trees = ["chain4"]
        stage_cfg.profile.eval.families = ["eagle", "sps"]
        stage_cfg.profile.eval.repeats = 1
    summary = run_evaluation(stage_cfg)
    assert set(summary["methods"]) == {"baseline", "pld", "pld_hf", "hf_generate", "eagle-chain4", "sps-chain4",
                                       "sps_hf"}
    assert summary["methods"]["sps_hf"]["kind"] == "sps_hf" and summary["methods"]["sps_hf"]["heads"] == "sps"
    report = read(tmp_path / "results" / "eval" / "all" / "lossless_report.json")
    assert report["passed"] and report["methods"]["sps_hf"]["checked_turns"] == 4   # 2 questions x 2 turns
    assert report["methods"]["eagle-chain4"]["checked_turns"] == 4


def test_dflash_evaluates_losslessly_alone_and_with_prompt_lookup(stage_cfg, tmp_path):
    """DFlash's rows: its block drafted as a chain and as a tree grown per step with prompt lookup's chain merged
    in, every answer the baseline's."""
    from pipelines.evaluate import run_evaluation

    model, _ = build_tiny_model()
    torch.manual_seed(0)
    build_heads(HeadsConfig.for_base(model, family="dflash", num_heads=7, num_layers=2, share_lm_head=True),
                model).save(tmp_path / "results" / "heads" / "dflash")
    with open_dict(stage_cfg):
        stage_cfg.profile.eval.trees = ["chain4", "eagle2_pld"]
        stage_cfg.profile.eval.families = ["dflash"]
        stage_cfg.profile.eval.repeats = 1
    summary = run_evaluation(stage_cfg)
    assert {"dflash-chain4", "dflash-eagle2_pld"} <= set(summary["methods"])
    assert summary["methods"]["dflash-eagle2_pld"]["lookup_branch"]
    report = read(tmp_path / "results" / "eval" / "all" / "lossless_report.json")
    assert report["passed"] and report["methods"]["dflash-eagle2_pld"]["checked_turns"] == 4


def test_a_contenders_kind_is_one_of_the_kinds_and_its_record_the_plain_name():
    from pipelines.methods import Contender, Kind

    pld = Contender("pld", "pld", None, reference="baseline")
    assert pld.kind is Kind.PLD and pld.kind.prompt_lookup and not pld.kind.greedy_reference
    assert json.loads(json.dumps(pld.describe()))["kind"] == "pld"
    assert Contender("ref", Kind.REFERENCE, None).kind.greedy_reference
    with pytest.raises(ValueError, match=r"contender 'x': kind 'tree' is not one of \['baseline', 'reference', 'heads'"):
        Contender("x", "tree", None)
