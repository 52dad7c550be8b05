"""Tables and plots from a small synthetic evaluate summary: published and ours side by side."""
from __future__ import annotations

import json

import pytest

from analysis import plots
from analysis.published import PUBLISHED, published_cells, published_value
from analysis.tables import (build_tables, calibration_rows, latex_escape, load_calibrations, load_summary, to_latex,
                             to_markdown)


def stat(mean, std=0.0, runs=None):
    return {"mean": mean, "std": std, "runs": runs if runs is not None else [mean]}


def method(kind, heads=None, tree=None, nodes=None, speedup=1.0, accept=1.0, hist=None, questions=2):
    per_cat = {c: {"speedup": stat(speedup * f), "decode_speedup": stat(1.2 * speedup * f), "throughput": stat(100.0),
                   "decode_throughput": stat(120.0), "accept_length": stat(accept)}
               for c, f in (("writing", 0.9), ("math", 1.1))}
    out = {"kind": kind, "heads": heads, "family": heads, "tree": tree, "tree_nodes": nodes,
           "speedup": stat(speedup, 0.05, [speedup - 0.05, speedup + 0.05]), "decode_speedup": stat(1.2 * speedup),
           "throughput": stat(100.0 * speedup), "decode_throughput": stat(120.0 * speedup),
           "accept_length": stat(accept), "per_category": per_cat,
           "accept_length_histogram": hist or {"1": 10, "2": 5}, "new_tokens": 100, "wall_time": 1.0,
           "steps": 60, "turns": 4, "questions": questions}
    if kind == "heads":        # the prompt lookups on this method's questions
        out["pld_speedups"] = {"pld": 1.1, "pld_hf": 1.25 if questions < 2 else 1.0}
    return out


@pytest.fixture
def summary():
    methods = {"baseline": method("baseline", speedup=1.0, hist={"1": 40}),
               "pld": method("pld", speedup=1.1, accept=1.2), "pld_hf": method("pld_hf", speedup=1.0, accept=1.7)}
    for heads, base in (("medusa1", 1.3), ("medusa2", 1.4), ("hydra", 1.5), ("hydra_pp", 1.6)):
        for tree, nodes in (("sparse64", 63), ("chain4", 4)):
            methods[f"{heads}-{tree}"] = method("heads", heads, tree, nodes, speedup=base + nodes / 1000,
                                                accept=base + 0.5, questions=1 if tree == "sparse64" else 2)
    return {"tag": "all", "model": "SmolLM2-135M-Instruct", "hardware": "2-core CPU (x86_64)", "profile": "cpu",
            "settings": {"num_questions": 2, "turns": 1, "max_new_tokens": 64, "repeats": 2,
                         "tree_questions": {"sparse64": 1}}, "baseline": "baseline", "methods": methods}


def test_published_cells_carry_model_hardware_and_source():
    assert published_value("medusa", "Vicuna-7B", "medusa1").value == 2.18
    assert published_value("hydra", "Vicuna-33B", "hydra_pp", "accept_length").value == 3.62
    assert published_value("specbench", "Vicuna-7B", "pld").value == 1.60
    assert published_value("medusa", "Vicuna-33B", "medusa1") is None        # "-" in the paper
    assert all(c.model and c.hardware and c.source for c in PUBLISHED)
    assert published_value("medusa", "Vicuna-7B", "medusa2").label == "Vicuna-7B, A100 (paper)"
    assert len(published_cells(table="hydra", metric="speedup")) == 9


def test_tables_put_published_and_ours_side_by_side(summary, tmp_path):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    tables = build_tables(load_summary(path))
    assert set(tables) == {"medusa", "hydra", "speed", "category"}          # no calibration data given

    md = to_markdown(tables["medusa"])
    assert "| Vicuna-7B | Vicuna-7B, A100 (paper) | 2.18x | 2.83x |" in md
    assert "| SmolLM2-135M-Instruct | SmolLM2-135M-Instruct, 2-core CPU (x86_64) (ours, tree sparse64) | 1.36x ± 0.05 | 1.46x ± 0.05 |" in md
    hydra = to_markdown(tables["hydra"])
    assert "2.70x / 3.70" in hydra and "1.60x / 1.75" in hydra           # Hydra paper and Spec-Bench rows
    assert ("(ours, tree chain4) | 1.30x ± 0.05 / 1.80 | 1.50x ± 0.05 / 2.00 | 1.60x ± 0.05 / 2.10 | 1.10x ± 0.05 / 1.20 "
            "| 1.00x ± 0.05 / 1.70 |") in hydra                       # both prompt lookups, ours and transformers'
    assert "| Vicuna-7B | Vicuna-7B, A100 (Spec-Bench) |" in hydra and "| 1.60x / 1.75 | - |" in hydra
    cat = to_markdown(tables["category"])
    assert "| writing | math | overall |" in cat and "| hydra-sparse64 |" in cat and "baseline |" not in cat
    assert "| pld_hf |" in cat

    tex = to_latex(tables["hydra"])
    assert r"\begin{tabular}" in tex and r"Hydra{+}{+}" in tex and r"$\pm$" in tex
    assert "Vicuna-13B & Vicuna-13B, GPU (paper) & 1.97x / 2.60" in tex
    assert latex_escape("hydra_pp 5%") == r"hydra\_pp 5\%"


def test_speed_table_shows_both_speedups_against_the_stronger_prompt_lookup(summary):
    speed = to_markdown(build_tables(summary)["speed"])
    assert "| Method | Tree nodes | Questions | End to end | Decode-only |" in speed
    # hydra-chain4: 1.504x end to end, 1.80x decode-only; PLDs on its 2 questions: pld 1.10x > pld_hf 1.00x
    assert "| hydra-chain4 | 4 | 2 | 1.50x ± 0.05 | 1.80x | 2.00 | 150.4 | 180.5 | 1.37x (pld) | 2/2 |" in speed
    # hydra-sparse64 ran on 1 question, where transformers' PLD (1.25x) was the stronger one
    assert "| hydra-sparse64 | 63 | 1 | 1.56x ± 0.05 | 1.88x | 2.00 | 156.3 | 187.6 | 1.25x (pld_hf) | 2/2 |" in speed
    assert "| baseline | - | 2 | 1.00x ± 0.05 | 1.20x |" in speed and "| pld_hf | - | 2 |" in speed


def test_categories_ahead_of_prompt_lookup_count_where_a_method_beats_both(summary):
    """A category counts when the method's mean is above BOTH prompt lookups' there; ties do not count."""
    cat = summary["methods"]["pld_hf"]["per_category"]
    cat["writing"]["speedup"] = stat(5.0)           # transformers' PLD copies its way through writing
    speed = to_markdown(build_tables(summary)["speed"])
    assert "| 1.37x (pld) | 1/2 |" in speed           # hydra-chain4 wins math only
    cat["math"]["speedup"] = stat(summary["methods"]["hydra-chain4"]["per_category"]["math"]["speedup"]["mean"])
    assert "| 1.37x (pld) | 0/2 |" in to_markdown(build_tables(summary)["speed"])   # a tie is not a win
    assert "| pld | - | 2 |" in speed and speed.count("| - | - |") >= 3          # baseline and PLD rows: no count


def test_a_tree_on_a_subset_of_questions_gets_a_footnote(summary):
    tables = build_tables(summary)
    note = "sparse64: 1 of 2 questions (spread over the categories)"
    for name in ("medusa", "hydra", "speed", "category"):
        assert note in to_markdown(tables[name]), name
    assert "chain4: " not in to_markdown(tables["hydra"])
    assert note in to_latex(tables["hydra"])
    for m in summary["methods"].values():
        m["questions"] = 2
    assert "of 2 questions" not in to_markdown(build_tables(summary)["hydra"])


def test_calibration_rows_pair_predictions_with_replays_and_measurements(summary, tmp_path):
    summary["methods"]["hydra-optimal"] = method("heads", "hydra", "optimal", 16, speedup=1.7, accept=2.4)
    (tmp_path / "hydra").mkdir()
    (tmp_path / "hydra" / "calibration.json").write_text(json.dumps(
        {"budgets": [{"budget": 4, "predicted_accept_length": 2.2, "replay_accept_length": 2.1},
                     {"budget": 16, "predicted_accept_length": 2.6, "replay_accept_length": 2.5}],
         "fixed_trees": {"chain4": {"budget": 4, "predicted_accept_length": 2.1, "replay_accept_length": 2.0}},
         "chosen_budget": 16, "chosen": {"predicted_speedup": 1.65}}))
    rows = calibration_rows(summary, load_calibrations(tmp_path))
    by_tree = {r["tree"]: r for r in rows}
    # the greedy 4-node tree is not chain4: it gets no measurement although the node counts agree
    assert by_tree["budget 4"]["measured"] is None and not by_tree["budget 4"]["chosen"]
    assert by_tree["chain4"] == {"heads": "hydra", "tree": "chain4", "budget": 4, "chosen": False, "predicted": 2.1,
                                 "replayed": 2.0, "measured": 2.0, "measured_tree": "chain4"}
    assert by_tree["budget 16"]["chosen"] and by_tree["budget 16"]["measured"] == 2.4
    tables = build_tables(summary, load_calibrations(tmp_path))
    md = to_markdown(tables["calibration"])
    assert "| hydra | budget 16 (chosen: tree=optimal) | 16 | 2.60 | 2.50 | 2.40 | +0.10 (+4%) | +0.20 (+8%) |" in md
    assert "| hydra | chain4 | 4 | 2.10 | 2.00 | 2.00 | +0.10 (+5%) | +0.10 (+5%) |" in md
    choice = to_markdown(tables["tree_choice"])
    # hydra: sparse64 1.563x, chain4 1.504x, optimal 1.7x -> 1.09x the best fixed tree
    assert "| hydra | 1.56x ± 0.05 | 1.50x ± 0.05 | 1.70x ± 0.05 | 16 | 1.65x | 1.09x (at least as fast) |" in choice


def test_tree_choice_table_flags_a_slower_optimal_tree(summary):
    summary["methods"]["medusa1-optimal"] = method("heads", "medusa1", "optimal", 8, speedup=1.2)
    md = to_markdown(build_tables(summary)["tree_choice"])
    assert "| medusa1 |" in md and "0.88x (slower)" in md and "| hydra |" not in md


def test_plots_are_written(summary, tmp_path):
    rows = [{"heads": "hydra", "tree": "budget 4", "budget": 4, "predicted": 2.2, "replayed": 2.1, "measured": None},
            {"heads": "hydra", "tree": "budget 8", "budget": 8, "predicted": 2.4, "replayed": 2.2, "measured": 2.3,
             "measured_tree": "optimal"},
            {"heads": "hydra", "tree": "chain4", "budget": 4, "predicted": 2.1, "replayed": 2.0, "measured": 2.0,
             "measured_tree": "chain4"}]
    paths = [plots.plot_speedup_per_category(summary, tmp_path / "cat.png", tree="sparse64"),
             plots.plot_accept_histogram(summary, tmp_path / "hist.png", tree="sparse64"),
             plots.plot_speedup_vs_tree_size(summary, tmp_path / "size.png"),
             plots.plot_calibration(rows, tmp_path / "cal.png"),
             plots.plot_calibration([], tmp_path / "empty.png")]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_tables_stage_writes_reports(summary, tmp_path):
    from hydra import compose, initialize_config_dir

    from pipelines.common import CONF_DIR
    from pipelines.tables import make_reports

    (tmp_path / "results" / "eval" / "all").mkdir(parents=True)
    (tmp_path / "results" / "eval" / "all" / "summary.json").write_text(json.dumps(summary))
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=[f"paths.results={tmp_path / 'results'}",
                                                       f"paths.reports={tmp_path / 'reports'}"])
    paths = make_reports(cfg)
    names = {p.name for p in paths}
    assert names == {"tables.md", "tables.tex", "speedup.csv", "speedup_per_category.png",
                     "accept_length_histogram.png", "speedup_vs_tree_size.png", "calibration.png",
                     "speedup_intervals.png", "comparisons.png", "results.md"}
    md = (tmp_path / "reports" / "tables.md").read_text()
    assert "Vicuna-7B, A100 (paper)" in md and "(ours, tree sparse64)" in md and "max_new_tokens=64" in md
    csv_lines = (tmp_path / "reports" / "speedup.csv").read_text().splitlines()
    assert csv_lines[0].startswith("method,heads,tree,tree_nodes,speedup") and len(csv_lines) == 1 + 11
    assert "decode_speedup" in csv_lines[0].split(",") and any(line.startswith("pld_hf,") for line in csv_lines)


@pytest.mark.parametrize("tree, nodes, flag, shown", [("dynamic", 16, "cut_by_cost", "<= 16"),
                                                     ("optimal_pld", 4, "lookup_branch", "4 + lookup")])
def test_an_adaptive_tree_is_shown_but_not_counted_as_fixed(summary, tree, nodes, flag, shown):
    """A tree cut per step (dynamic) or grown by a lookup branch (optimal_pld) has its own column in the tree
    choice table, after optimal, and is not one of the fixed trees optimal is compared with."""
    summary["methods"]["medusa1-optimal"] = method("heads", "medusa1", "optimal", 4, speedup=1.45)
    summary["methods"][f"medusa1-{tree}"] = {**method("heads", "medusa1", tree, nodes, speedup=1.6), flag: True}
    tables = build_tables(summary)
    md = to_markdown(tables["tree_choice"])
    header = md.splitlines()[2]
    assert header.index("| optimal |") < header.index(f"| {tree} |") < header.index("Optimal nodes")
    assert "1.60x" in md and "1.06x (at least as fast)" in md      # 1.45 / sparse64 1.363, not / this tree's 1.6
    assert shown in to_markdown(tables["speed"])


def test_results_document_shows_runs_of_one_method_and_the_official_code_comparison(summary, tmp_path):
    from hydra import compose, initialize_config_dir

    from pipelines.common import CONF_DIR
    from pipelines.tables import make_reports

    (tmp_path / "results" / "eval" / "all").mkdir(parents=True)
    (tmp_path / "results" / "eval" / "all" / "summary.json").write_text(json.dumps(summary))
    single = {"tag": "sps-optimal", "lossless": True, "lossless_checked_turns": 96, "num_questions": 24,
              "max_new_tokens": 128, "baseline_tokens_per_s": 10.5,
              "methods": {"sps-optimal": {"speedup": 0.95, "speedup_ci": [0.9, 1.0], "accept_length": 1.42,
                                          "accept_length_ci": [1.38, 1.46], "questions": 24,
                                          "speedup_pooled": {"value": 0.94, "ci": [0.89, 0.99]}},
                          "sps_hf": {"speedup": 0.64, "speedup_ci": [0.61, 0.68], "accept_length": 1.33,
                                     "accept_length_ci": [1.3, 1.36], "questions": 24}}}
    (tmp_path / "reports" / "metrics").mkdir(parents=True)
    (tmp_path / "reports" / "metrics" / "evaluate_sps-optimal.json").write_text(json.dumps(single))
    row = {"steps_compared": 315, "identical": True, "first_mismatch": None, "steps_accepting_drafts": 159,
           "mean_tokens_per_step": 1.64, "tokens_per_second": {"ours": 3.87, "official": 1.36}}
    report = {"machine": "AMD EPYC", "threads": 2, "official": "medusa-llm 0.1",
              "cases": {"trained": {"questions": 8, "new_tokens": 64, "baseline_tokens_per_second": 6.23,
                                    "trees": {"head63": row}}}}
    (tmp_path / "reports" / "conformance.json").write_text(json.dumps(report))
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=[f"paths.results={tmp_path / 'results'}",
                                                       f"paths.reports={tmp_path / 'reports'}"])
    make_reports(cfg)
    text = (tmp_path / "reports" / "results.md").read_text()
    assert "## Runs of one method each" in text and "`sps-optimal`: 24 questions" in text
    assert "| sps-optimal | 24 | 0.95x (0.90 to 1.00) | 0.94x (0.89 to 0.99) | 1.42 (1.38 to 1.46) |" in text
    assert "| sps_hf | 24 | 0.64x (0.61 to 0.68) | - | 1.33 (1.30 to 1.36) |" in text
    assert "## Against the authors' Medusa code" in text and "against medusa-llm 0.1" in text
    assert "| trained (8 q x 64 tok) | HEAD, mc_sim_7b_63 (63 nodes) | 315 | yes | 159 | 1.64 | 3.87 | 1.36 | 2.85x |" in text
