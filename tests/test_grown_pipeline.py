"""pytest tests/test_grown_pipeline.py: the tree grown per step in the pipeline.

- calibrate (tiny model, random heads): the replay of grown trees against a by-hand count, and the stage's
  chosen (depth, top_k, nodes) in its metrics and in dynamic_tree.json, which tree=dynamic_optimal loads;
  draft heads' depths capped at their number, EAGLE's not.
- evaluate: tree=dynamic_optimal and dynamic_optimal_pld resolve from that file and decode losslessly.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from omegaconf import open_dict

from models.base import build_tiny_model
from models.engine.trees import GrownTree, tree_from_config
from models.shared import HeadsConfig
from models.methods import build_heads
from models.measure.grown_calibration import GrownReplay, accepted_drafts, grown_settings
from tests.test_calibration import _tiny_stage_config, _write_tiny_distilled
from tests.test_evaluate import read, stage_cfg  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_accepted_drafts_restrict_the_ranking_to_the_levels_and_nodes():
    """One position: candidates ranked root, a(1), b(1), c(2), d(2), e(3); the greedy path is b -> d -> e."""
    replay = GrownReplay(2, path_levels=[[1, 2, 3]], path_order=[[2, 4, 5]],
                         ranked_levels=[np.array([0, 1, 1, 2, 2, 3])])
    got = {(lv, n): int(accepted_drafts(replay, lv, n)[0]) for lv in (1, 2, 3) for n in (1, 2, 3, 4, 5)}
    assert got[(1, 1)] == 0 and got[(1, 2)] == 1 and got[(1, 5)] == 1       # one level: b alone
    assert got[(2, 3)] == 1 and got[(2, 4)] == 2 and got[(3, 4)] == 2 and got[(3, 5)] == 3


def test_settings_cap_the_depth_where_the_heads_stop():
    assert grown_settings([3, 5], [4], [8], max_levels=4) == [(3, 4, 8)]
    assert grown_settings([3, 5], [4], [8], max_levels=None) == [(3, 4, 8), (5, 4, 8)]


@pytest.mark.parametrize("heads_name", ["hydra", "eagle"])
def test_calibrate_chooses_a_grown_tree_and_writes_it_in_its_metrics(tmp_path, heads_name):
    from pipelines.calibrate import calibrate

    cfg = _tiny_stage_config(tmp_path, heads_name)
    with open_dict(cfg):
        cfg.profile.calibrate.grown = {"depth": [1, 3], "top_k": [2, 3], "nodes": [2, 6], "every": 2}
    model, tok = build_tiny_model(seed=0)
    _write_tiny_distilled(tmp_path / "distilled", tok)
    config = HeadsConfig.for_base(model, family=cfg.heads.family, num_heads=2, num_layers=1, share_lm_head=True)
    build_heads(config, model).save(tmp_path / "results" / "heads" / heads_name)
    done = calibrate(cfg)
    rows = done["result"]["grown"]
    depths = {r["depth"] for r in rows}
    assert depths == ({1, 3} if heads_name == "eagle" else {1})             # 2 heads: 2 levels at most
    assert len(rows) == len(depths) * 4 and all(r["positions"] > 0 for r in rows)
    assert all(1.0 <= r["predicted_accept_length"] <= 2 + r["depth"] and r["predicted_tokens_per_s"] > 0 for r in rows)
    best = max(rows, key=lambda r: (r["predicted_tokens_per_s"], -r["nodes"], -r["depth"], -r["top_k"]))
    metrics = json.loads((tmp_path / "reports" / "metrics" / f"calibrate_{heads_name}.json").read_text())
    assert {k: metrics[f"dynamic_{k}"] for k in ("depth", "top_k", "nodes")} == \
        {k: best[k] for k in ("depth", "top_k", "nodes")}
    file = tmp_path / "results" / "calibrate" / heads_name / "dynamic_tree.json"
    assert file in done["files"]
    tree = tree_from_config({"kind": "file", "name": "dynamic_optimal", "file": str(file)})
    assert tree == GrownTree("dynamic_optimal", best["depth"], best["top_k"], best["nodes"])


def test_evaluate_runs_the_calibrated_grown_tree_alone_and_with_prompt_lookup(stage_cfg, tmp_path):  # noqa: F811
    from pipelines.evaluate import run_evaluation

    folder = tmp_path / "results" / "calibrate" / "hydra"
    folder.mkdir(parents=True)
    (folder / "dynamic_tree.json").write_text(json.dumps({"kind": "grown", "name": "dynamic_optimal", "depth": 3,
                                                          "top_k": 3, "nodes": 8}))
    with open_dict(stage_cfg):
        stage_cfg.profile.eval.trees = ["dynamic_optimal", "dynamic_optimal_pld"]
        stage_cfg.profile.eval.families = ["hydra"]
        stage_cfg.profile.eval.repeats = 1
    summary = run_evaluation(stage_cfg)
    alone, pld = summary["methods"]["hydra-dynamic_optimal"], summary["methods"]["hydra-dynamic_optimal_pld"]
    assert alone["grown"] == {"depth": 3, "top_k": 3, "nodes": 8} and alone["tree_nodes"] == 8
    assert pld["lookup_branch"] is True and pld["tree"] == "dynamic_optimal_pld" and alone["lookup_branch"] is False
    report = read(tmp_path / "results" / "eval" / "all" / "lossless_report.json")
    assert report["passed"] and report["methods"]["hydra-dynamic_optimal_pld"]["checked_turns"] == 4


def test_the_cpu_profile_evaluates_the_grown_trees():
    from omegaconf import OmegaConf

    from pipelines.common import CONF_DIR

    trees = OmegaConf.load(f"{CONF_DIR}/profile/cpu.yaml").eval.trees
    assert {"dynamic_optimal", "dynamic_optimal_pld"} <= set(trees)


def test_the_cpu_calibration_grid_reaches_below_the_earlier_floor():
    """Depth 1-2, top_k 2-3 and nodes 2-3 beside the earlier grid ({3, 5, 7} x {4, 8} x {4, 8, 16, 32}), where the
    committed run chose the floor for most families; every combination is a setting calibration tries."""
    from omegaconf import OmegaConf

    from pipelines.common import CONF_DIR

    g = OmegaConf.load(f"{CONF_DIR}/profile/cpu.yaml").calibrate.grown
    assert set(g.depth) == {1, 2, 3, 5, 7} and set(g.top_k) == {2, 3, 4, 8} and set(g.nodes) == {2, 3, 4, 8, 16, 32}
    settings = grown_settings(g.depth, g.top_k, g.nodes, max_levels=None)
    assert len(settings) == 5 * 4 * 6 and (1, 2, 2) in settings and (7, 8, 32) in settings
    assert grown_settings(g.depth, g.top_k, g.nodes, max_levels=3)[-1] == (2, 8, 32)   # heads of 3 stop at depth 2


def fitted_heads(family: str, lr: float):
    """(model, tok, heads, prompts, greedy sequences): heads that get some drafts accepted, not all. EAGLE: its layer
    made the one-layer base's own, perturbed (tests/test_sampling_ar.py); the others partly fitted."""
    from models.measure.calibration import greedy_continuations
    from tests.test_calibration import _fit_heads
    from tests.test_sampling_ar import eagle_like_the_base

    torch.manual_seed(0)
    model, tok = build_tiny_model(seed=1, num_layers=1 if family == "eagle" else 2)
    heads = build_heads(HeadsConfig.for_base(model, family=family, num_heads=3, share_lm_head=True), model)
    for p in model.parameters():
        p.requires_grad_(False)
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            return_dict=True)["input_ids"]) for q in ["Hi there", "What is 2+2?"]]
    seqs = greedy_continuations(model, prompts, 40)
    if family == "eagle":
        eagle_like_the_base(model, heads.eagle, scale=0.3)
    else:
        _fit_heads(model, heads, seqs, [len(p) - 1 for p in prompts], lr=lr)
    return model, tok, heads.eval(), prompts, seqs


@pytest.mark.parametrize("family,lr", [("hydra", 3e-3), ("medusa", 1e-2), ("eagle", None)])
def test_replayed_grown_trees_accept_what_the_decoder_accepts(family, lr):
    """The replay's acceptance is the decoder's: on the base's greedy continuation, the drafts the replay counts at
    the positions decoding visits are the decoder's own per step (some drafts accepted, some not), and the predicted
    accepted length, walked along those positions, is the decoded one (within 5%; the mean over every position is
    not what decoding sees)."""
    from models.engine.decoding import generate
    from models.engine.drafting import heads_drafter
    from models.measure.grown_calibration import replay_grown, visited_steps

    model, tok, heads, prompts, seqs = fitted_heads(family, lr)
    N, tree = 40, GrownTree("t", depth=3 if family == "eagle" else 2, top_k=3, nodes=6)
    accepted, rejected = False, False
    for p, s in zip(prompts, seqs):
        replay = replay_grown(model, heads, [s], [len(p) - 1], tree.top_k, tree.depth)
        drafts = accepted_drafts(replay, tree.levels, tree.nodes)               # position start + i
        assert len(drafts) == len(s) - len(p)
        every2 = replay_grown(model, heads, [s], [len(p) - 1], tree.top_k, tree.depth, every=2)   # chunked advances
        assert accepted_drafts(every2, tree.levels, tree.nodes).tolist() == drafts[::2].tolist()
        res = generate(model, tok, p, heads_drafter(heads, tree), max_new_tokens=N, stop_token_ids=[])
        assert res.new_tokens == s[len(p):]
        k = next(i for i in range(len(res.accept_lengths)) if sum(res.accept_lengths[:i + 1]) > N - 5)
        visited = np.cumsum([0] + res.accept_lengths[:k - 1])
        assert [int(drafts[t]) + 1 for t in visited] == res.accept_lengths[:k]
        accepted |= max(res.accept_lengths[:k]) > 1
        rejected |= min(res.accept_lengths[:k]) <= tree.levels
        walked = visited_steps(replay, drafts)
        assert walked[:k] == res.accept_lengths[:k]
        predicted, decoded = np.mean(walked[:k]), np.mean(res.accept_lengths[:k])
        assert abs(predicted / decoded - 1) <= 0.05
    assert accepted and rejected


def test_bench_load_times_a_stand_in_grown_tree_before_calibrate(compose_cfg):
    from models.engine.trees import tree_option
    from pipelines.bench.load import stand_in
    from pipelines.methods import resolve_tree, tree_config, with_costs

    cfg = compose_cfg()
    option = with_costs(cfg, stand_in(tree_option(tree_config(cfg, "dynamic_optimal_pld", "hydra"),
                                                  "dynamic_optimal_pld")))
    tree = option.tree
    assert isinstance(tree, GrownTree) and (tree.top_k, tree.nodes) == (4, 12) and option.lookup
    assert option.step_cost is None
    option = resolve_tree(cfg, tree_config(cfg, "eagle2_pld", "eagle"), "eagle2_pld")
    tree = option.tree
    assert (tree.name, tree.depth, tree.top_k, tree.nodes, option.lookup) == ("eagle2_pld", 5, 10, 59, True)


def test_the_results_judge_eagle2s_claim_and_compare_grown_with_fixed_trees():
    """eagle-dynamic_optimal 1.05x eagle-optimal's speed on every question and 1.5x its accepted tokens: the claim
    row (published 1.12x speed) is "smaller here" with the accepted-length ratio as its reason; the standard
    comparisons pair the grown tree with the fixed one; the tables show the grown tree as EAGLE-2 (ours)."""
    import random

    from analysis.claims import claim_rows
    from analysis.comparisons import standard_comparisons
    from analysis.tables import eagle2_method, tree_nodes
    from models.measure.benchmark import summarize_method
    from tests.test_intervals import _records, _summary

    summary, rng = _summary(), random.Random(3)
    base = [rng.uniform(2.0, 3.0) for _ in range(16)]
    for name, f, acc in (("eagle-optimal", 1.3, 2), ("eagle-dynamic_optimal", 1.3 * 1.05, 3)):
        recs = _records(name, [t / (f * rng.uniform(0.995, 1.005)) for t in base], accept=acc)
        summary["methods"][name] = {"kind": "heads", "heads": "eagle", "tree": name.partition("-")[2], "tree_nodes": 12,
                                    **summarize_method([recs], [_records("baseline", base)])}
    summary["methods"]["eagle-dynamic_optimal"]["grown"] = {"depth": 5, "top_k": 4, "nodes": 12}
    row = {r["claim"]: r for r in claim_rows(summary)}["EAGLE-2's dynamic tree beats EAGLE's static tree"]
    assert row["verdict"] == "smaller here" and "eagle-dynamic_optimal / eagle-optimal" in row["ours"]
    assert "accepted length 1.50x" in row["reason"] and "1.12x" in row["published"]
    questions = {r["question"]: r for r in standard_comparisons(summary)}
    grown = questions["EAGLE: the tree grown per step beats the calibrated fixed tree (accepted length)"]
    assert grown["ratio"] == pytest.approx(1.5) and grown["verdict"] == "A ahead"
    assert eagle2_method(summary, "optimal") is summary["methods"]["eagle-dynamic_optimal"]
    assert tree_nodes(summary["methods"]["eagle-dynamic_optimal"]) == "12 grown"
    del summary["methods"]["eagle-dynamic_optimal"]
    assert "EAGLE-2's dynamic tree beats EAGLE's static tree" not in {r["claim"] for r in claim_rows(summary)}


def test_make_bench_times_each_grown_tree_beside_a_fixed_tree_of_as_many_drafts():
    from pipelines.bench.verify import DEFAULTS, bench_trees, same_size_fixed

    trees = bench_trees(dict(DEFAULTS))
    names = list(trees)
    for name, tree in trees.items():
        if isinstance(tree, GrownTree):
            twin = trees[names[names.index(name) + 1]]
            assert not isinstance(twin, GrownTree) and twin.num_nodes == tree.num_nodes
    spec = tree_from_config({"kind": "paths", "top_k": 3, "paths": [[0], [1], [1, 0], [0, 0], [2], [0, 0, 0]]})
    assert same_size_fixed(spec, 3).paths == ((0,), (1,), (1, 0))          # every kept path's parent kept before it
