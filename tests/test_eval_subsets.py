"""The run's budget levers in the evaluation: the calibrated kind (fixed or grown) calibrate did not choose runs on
fewer questions, except for the families that keep both; transformers' assisted generation on fewer questions; the
batch curve with prompt lookup merged in at some batch sizes only; a family's own trees beside the others'."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from pipelines.calibrate import write_choice
from pipelines.evaluate_batch import method_sizes
from pipelines.methods import Contender, calibrated_choice, family_trees, question_subsets

KINDS = {"optimal": "fixed", "optimal_pld": "fixed", "dynamic_optimal": "grown", "dynamic_optimal_pld": "grown"}


def config(tmp_path, **ev):
    return OmegaConf.create({"paths": {"results": str(tmp_path)},
                             "profile": {"eval": {"tree_questions": {"sparse64": 2}, "choice_trees": KINDS,
                                                  "unchosen_questions": 3, "both_choices": ["keeps"], **ev}}})


def questions(n=8):
    return [SimpleNamespace(question_id=100 + i, category="c") for i in range(n)]


def method(heads, tree, kind="heads"):
    return Contender(f"{heads}-{tree}", kind, None, heads_name=heads, tree_name=tree)


def test_calibrate_writes_the_faster_predicted_kind(tmp_path):
    assert write_choice(tmp_path, {"predicted_tokens_per_s": 10.0, "dynamic_predicted_tokens_per_s": 12.0}) == "grown"
    assert json.loads((tmp_path / "choice.json").read_text())["choice"] == "grown"
    assert write_choice(tmp_path, {"predicted_tokens_per_s": 12.0, "dynamic_predicted_tokens_per_s": 12.0}) == "fixed"


def test_the_unchosen_kind_runs_on_fewer_questions_and_a_family_in_both_choices_keeps_both(tmp_path):
    for heads, choice in (("h", "grown"), ("keeps", "fixed")):
        write_choice(tmp_path / "calibrate" / heads, {"predicted_tokens_per_s": 1.0 if choice == "grown" else 2.0,
                                                      "dynamic_predicted_tokens_per_s": 1.5})
    cfg = config(tmp_path)
    methods = [Contender("baseline", "baseline", None)] + [method(h, t) for h in ("h", "keeps")
                                                        for t in ("sparse64", *KINDS)]
    subsets = question_subsets(cfg, methods, questions())
    assert sorted(subsets) == ["h-optimal", "h-optimal_pld", "h-sparse64", "keeps-sparse64"]
    assert subsets["h-optimal"] == {100, 102, 105}                  # 3 of 8, spread
    assert len(subsets["h-sparse64"]) == 2                          # tree_questions still wins for its trees


def test_assisted_generation_on_a_subset(tmp_path):
    cfg = config(tmp_path, unchosen_questions=None, assisted_questions=4)
    subsets = question_subsets(cfg, [method("sps", None, kind="sps_hf"), method("sps", "optimal")], questions())
    assert list(subsets) == ["sps-None"] and len(subsets["sps-None"]) == 4


def test_a_missing_choice_names_the_file_and_the_stage(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"choice.json is missing.*calibrate@h"):
        calibrated_choice(config(tmp_path), "h")
    (tmp_path / "calibrate" / "h").mkdir(parents=True)
    (tmp_path / "calibrate" / "h" / "choice.json").write_text('{"choice": "both"}')
    with pytest.raises(ValueError, match="'both' is neither"):
        calibrated_choice(config(tmp_path), "h")


def test_prompt_lookup_in_the_batch_curve_at_its_sizes_only():
    cfg = OmegaConf.create({"profile": {"eval": {"batch_sizes": [1, 2, 4, 8], "batch_lookup_sizes": [8]}}})
    assert method_sizes(cfg, "h-batch", [2, 4, 8]) == [2, 4, 8]
    assert method_sizes(cfg, "h-batch_pld", [2, 4, 8]) == [8]
    cfg.profile.eval.batch_lookup_sizes = None
    assert method_sizes(cfg, "h-batch_pld", [2, 4, 8]) == [2, 4, 8]
    cfg.profile.eval.batch_lookup_sizes = [16]
    with pytest.raises(ValueError, match=r"batch_lookup_sizes=\[16\] names \[16\]"):
        method_sizes(cfg, "h-batch_pld", [2, 4, 8])


def sweep(mode="heads", trees=("optimal", "cut")):
    return SimpleNamespace(mode=mode, trees=list(trees))


def test_a_familys_own_trees_join_its_sweep_only_and_share_their_questions(tmp_path):
    cfg = config(tmp_path, family_trees={"dspark": ["cut", "uncut"]}, tree_questions={"cut": 3, "uncut": 3})
    assert family_trees(cfg, sweep(), "dspark") == ["uncut"]                # cut is already a tree of every family
    assert family_trees(cfg, sweep(trees=["optimal"]), "dspark") == ["cut", "uncut"]
    assert family_trees(cfg, sweep(mode="all"), "dspark") == ["uncut"]
    assert family_trees(cfg, sweep(), "dflash") == []
    assert family_trees(cfg, sweep(mode="selected"), "dspark") == []        # a method asked for by hand runs alone
    assert family_trees(config(tmp_path), sweep(), "dspark") == []          # a profile without the key
    subsets = question_subsets(cfg, [method("dspark", "cut"), method("dspark", "uncut")], questions())
    assert subsets["dspark-cut"] == subsets["dspark-uncut"] and len(subsets["dspark-cut"]) == 3   # paired


def test_a_familys_own_trees_must_be_a_list_of_names(tmp_path):
    with pytest.raises(ValueError, match=r"family_trees.dspark='cut'.*list of conf/tree option names"):
        family_trees(config(tmp_path, family_trees={"dspark": "cut"}), sweep(), "dspark")
