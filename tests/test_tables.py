"""Tables and plots from a small synthetic evaluate summary: published and ours side by side."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from analysis import plots
from analysis.results import results_markdown
from analysis.published import PUBLISHED, published_cells, published_models, published_value
from analysis.calibration_tables import calibration_rows
from analysis.render import build_tables, latex_escape, to_latex, to_markdown
from analysis.tables import load_calibrations, load_summary


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
    # the leaderboard at fd2c1cd and the EAGLE-3 paper, beside (not instead of) the earlier leaderboard
    assert published_value("specbench", "Vicuna-7B", "eagle2").value == 2.84
    assert published_value("specbench_2025", "Vicuna-7B", "eagle2").value == 2.36
    assert published_value("specbench_2025", "Vicuna-7B", "sps", "accept_length").value == 2.28
    assert published_value("specbench_2025", "Vicuna-13B", "eagle3").label == "Vicuna-13B, A100 (Spec-Bench fd2c1cd)"
    assert published_value("eagle3", "LLaMA-3.1-8B", "eagle3", "accept_length").value == 6.13
    assert published_value("eagle3", "Vicuna-13B", "medusa1").label == "Vicuna-13B, GPU (paper)"


def _paragraph(text: str, heading: str) -> str:
    """The paragraph of docs/reference.md that starts with **heading**, on one line."""
    return " ".join(text.split("**" + heading + "**", 1)[1].split("\n\n", 1)[0].split())


@pytest.mark.parametrize("table, heading, names", [
    ("specbench_2025", "Spec-Bench leaderboard",
     {"eagle2": "EAGLE-2", "eagle": "EAGLE", "hydra": "Hydra", "medusa1": "Medusa-1", "sps": "SpS with a 68M draft model",
      "pld": "prompt lookup", "rest": "REST", "lookahead": "Lookahead", "eagle3": "EAGLE-3"}),
    ("eagle3", "EAGLE-3 paper", {"eagle2": "EAGLE-2", "eagle": "EAGLE", "medusa1": "Medusa"}),
])
def test_published_cells_match_the_reference(table, heading, names):
    """Every cell of the newer tables is "speedup x / accepted" as docs/reference.md writes it, under its model."""
    doc = _paragraph((Path(__file__).resolve().parents[1] / "docs" / "reference.md").read_text(), heading)
    models = published_models(table)
    assert models == (["Vicuna-7B", "Vicuna-13B"] if table == "specbench_2025" else ["Vicuna-13B", "LLaMA-3.1-8B"])
    for i, model in enumerate(models):
        part = doc.split(model, 1)[1]
        part = part.split(models[i + 1], 1)[0] if i + 1 < len(models) else part
        if table == "specbench_2025":
            part = part.split("An earlier version", 1)[0]     # the earlier leaderboard is the `specbench` table
        methods = {c.method for c in published_cells(table, model)}
        for method in methods:
            sp = published_value(table, model, method).value
            al = published_value(table, model, method, "accept_length").value
            # the family's own figure leads its model's clause (EAGLE-3 paper: "Vicuna-13B 5.58x / 6.65 accepted")
            name = "" if table == "eagle3" and method == "eagle3" else re.escape(names[method]) + " "
            assert re.search(rf"(^|[ (,:]){name}{sp:.2f}x / {al:.2f}\b", part), (table, model, method)
        assert len(re.findall(r"\d\.\d\dx / \d\.\d\d", part)) == len(methods), (table, model)  # none left out


def test_tables_put_published_and_ours_side_by_side(summary, tmp_path):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    tables = build_tables(load_summary(path))
    assert set(tables) == {"medusa", "hydra", "eagle", "speed", "category"}  # no calibration data given

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


def test_eagle_table_puts_the_papers_eagle_family_beside_ours(summary):
    """Spec-Bench (fd2c1cd) and the EAGLE-3 paper, then ours: the main run on the calibrated trees (EAGLE-2 = the EAGLE
    heads on the tree cut per step by cost) and the runs of one method each; "-" where a method was not run."""
    ms = summary["methods"]
    ms["eagle-optimal"] = method("heads", "eagle", "optimal", 4, speedup=1.7, accept=2.2)
    ms["eagle-cut"] = {**method("heads", "eagle", "cut", 16, speedup=1.8, accept=2.4), "cut_by_cost": True}
    ms["hydra-optimal"] = method("heads", "hydra", "optimal", 4, speedup=1.5, accept=1.9)
    ms["medusa1-optimal_pld"] = {**method("heads", "medusa1", "optimal_pld", 4, speedup=1.45, accept=1.8),
                                 "lookup_branch": True}
    runs = {"eagle3-optimal_pld": {"tag": "eagle3-optimal_pld", "methods": {
                "eagle3-optimal_pld": {"speedup": 2.05, "accept_length": 3.1, "questions": 2},
                "eagle3-optimal": {"speedup": 1.9, "accept_length": 2.9, "questions": 2},
                "pld": {"speedup": 1.2, "accept_length": 1.4}, "pld_hf": {"speedup": 1.1, "accept_length": 1.5}}},
            "medusa2-optimal": {"tag": "medusa2-optimal", "methods": {"medusa2-optimal": {"speedup": 1.3}}}}
    table = build_tables(summary, single_runs=runs)["eagle"]
    md = to_markdown(table)
    assert "| Base model | Measured on | EAGLE | EAGLE-2 | EAGLE-3 | SpS | Hydra | Medusa-1 | PLD |" in md
    assert ("| Vicuna-7B | Vicuna-7B, A100 (Spec-Bench fd2c1cd) | 2.10x / 3.58 | 2.36x / 4.34 | - | 1.52x / 2.28 "
            "| 2.07x / 3.26 | 1.71x / 2.31 | 1.66x / 1.75 |") in md
    assert "| Vicuna-13B | Vicuna-13B, A100 (Spec-Bench fd2c1cd) | - | 2.46x / 4.43 | 3.02x / 5.71 | - | - | - | - |" in md
    assert ("| Vicuna-13B | Vicuna-13B, GPU (paper) | 3.07x / 3.98 | 4.26x / 4.83 | 5.58x / 6.65 | - | - | 2.07x / 2.59 "
            "| - |") in md
    assert "| LLaMA-3.1-8B | LLaMA-3.1-8B, GPU (paper) | - | - | 4.40x / 6.13 | - | - | - | - |" in md
    ours = "| SmolLM2-135M-Instruct | SmolLM2-135M-Instruct, 2-core CPU (x86_64) (ours, "
    assert (ours + "tree optimal) | 1.70x ± 0.05 / 2.20 | 1.80x ± 0.05 / 2.40 | - | - | 1.50x ± 0.05 / 1.90 | - "
            "| 1.10x ± 0.05 / 1.20 |") in md                    # no eagle3, sps or medusa1 on optimal here
    assert ours + "tree optimal_pld) | - | - | - | - | - | 1.45x ± 0.05 / 1.80 | 1.10x ± 0.05 / 1.20 |" in md
    assert ours + "run eagle3-optimal_pld, tree optimal) | - | - | 1.90x / 2.90 | - | - | - | 1.20x / 1.40 |" in md
    assert ours + "run eagle3-optimal_pld, tree optimal_pld) | - | - | 2.05x / 3.10 | - | - | - | 1.20x / 1.40 |" in md
    assert "run medusa2-optimal" not in md and "Vicuna-7B, A100 (Spec-Bench) |" not in md   # not its families; old board
    assert "EAGLE-2 (ours): the EAGLE heads on tree=dynamic_optimal" in md
    assert len(table.rows) == 8
    tex = to_latex(table)
    assert r"\label{tab:eagle}" in tex and "EAGLE-3 & SpS" in tex and r"run eagle3-optimal\_pld" in tex
    # nothing of ours: only the published rows
    bare = build_tables({**summary, "methods": {k: v for k, v in ms.items() if v["kind"] != "heads"}})["eagle"]
    assert len(bare.rows) == 4 and "ours" not in "".join(r[1] for r in bare.rows)


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


def write_chain_runs(summary: dict, folder: Path) -> None:
    """The summary split as the DVC stages write it: results/eval/references (the baseline and the prompt lookups)
    and results/eval/<heads> (the baseline and that family's methods), each run with its own baseline."""
    ms = summary["methods"]
    runs = {"references": [n for n, m in ms.items() if m["kind"] in ("pld", "pld_hf")]}
    for n, m in ms.items():
        if m["kind"] == "heads":
            runs.setdefault(m["heads"], []).append(n)
    for tag, names in runs.items():
        (folder / tag).mkdir(parents=True)
        run = {**summary, "tag": tag, "methods": {"baseline": ms["baseline"], **{n: ms[n] for n in names}}}
        (folder / tag / "summary.json").write_text(json.dumps(run))


def test_tables_stage_writes_reports(summary, tmp_path):
    from hydra import compose, initialize_config_dir

    from pipelines.common import CONF_DIR
    from pipelines.tables import make_reports

    write_chain_runs(summary, tmp_path / "results" / "eval")
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=[f"paths.results={tmp_path / 'results'}",
                                                       f"paths.reports={tmp_path / 'reports'}"])
    paths = make_reports(cfg)
    names = {p.name for p in paths}
    assert names == {"tables.md", "tables.tex", "speedup.csv", "speedup_per_category.png",
                     "accept_length_histogram.png", "speedup_vs_tree_size.png", "calibration.png",
                     "speedup_intervals.png", "comparisons.png", "results.md", "batch_curve.md", "batch_curve.png"}
    md = (tmp_path / "reports" / "tables.md").read_text()
    assert "Vicuna-7B, A100 (paper)" in md and "(ours, tree sparse64)" in md and "max_new_tokens=64" in md
    csv_lines = (tmp_path / "reports" / "speedup.csv").read_text().splitlines()
    assert csv_lines[0].startswith("method,heads,tree,tree_nodes,speedup") and len(csv_lines) == 1 + 11
    assert "decode_speedup" in csv_lines[0].split(",") and any(line.startswith("pld_hf,") for line in csv_lines)
    results = (tmp_path / "reports" / "results.md").read_text()       # the committed GPU bench file's projection
    assert "not a reproduction" in results and "`reports/bench/gpu_h200_vicuna_7b.json`" in results


@pytest.mark.parametrize("tree, nodes, flag, shown", [("cut", 16, "cut_by_cost", "<= 16"),
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

    write_chain_runs(summary, tmp_path / "results" / "eval")
    single = {"tag": "sps-optimal", "lossless": True, "lossless_checked_turns": 96, "num_questions": 24,
              "max_new_tokens": 128, "baseline_tokens_per_s": 10.5,
              "methods": {"sps-optimal": {"speedup": 0.95, "speedup_ci": [0.9, 1.0], "accept_length": 1.42,
                                          "accept_length_ci": [1.38, 1.46], "questions": 24,
                                          "speedup_pooled": {"value": 0.94, "ci": [0.89, 0.99]}},
                          "sps_hf": {"speedup": 0.64, "speedup_ci": [0.61, 0.68], "accept_length": 1.33,
                                     "accept_length_ci": [1.3, 1.36], "questions": 24}}}
    row = {"steps_compared": 315, "identical": True, "first_mismatch": None, "steps_accepting_drafts": 159,
           "mean_tokens_per_step": 1.64, "tokens_per_second": {"ours": 3.87, "official": 1.36}}
    report = {"machine": "AMD EPYC", "threads": 2, "official": "medusa-llm 0.1",
              "cases": {"trained": {"questions": 8, "new_tokens": 64, "baseline_tokens_per_second": 6.23,
                                    "trees": {"head63": row}}}}
    (tmp_path / "reports" / "metrics").mkdir(parents=True)
    (tmp_path / "reports" / "metrics" / "evaluate_sps-optimal.json").write_text(json.dumps(single))   # by hand
    (tmp_path / "reports" / "conformance.json").write_text(json.dumps(report))
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=[f"paths.results={tmp_path / 'results'}",
                                                       f"paths.reports={tmp_path / 'reports'}"])
    make_reports(cfg)
    text = (tmp_path / "reports" / "results.md").read_text()
    assert "## Runs of one method each" not in text           # the stage shows the chains' runs, not runs by hand
    assert "every speedup is over its own stage's baseline" in text
    text = results_markdown(summary, single_runs={"sps-optimal": single})
    assert "## Runs of one method each" in text and "`sps-optimal`: 24 questions" in text
    assert "| sps-optimal | 24 | 0.95x (0.90 to 1.00) | 0.94x (0.89 to 0.99) | 1.42 (1.38 to 1.46) |" in text
    assert "| sps_hf | 24 | 0.64x (0.61 to 0.68) | - | 1.33 (1.30 to 1.36) |" in text
    assert "## Against the authors' Medusa code" in (tmp_path / "reports" / "results.md").read_text()
    text = results_markdown(summary, conformance=report)
    assert "## Against the authors' Medusa code" in text and "against medusa-llm 0.1" in text
    assert "| trained (8 q x 64 tok) | HEAD, mc_sim_7b_63 (63 nodes) | 315 | yes | 159 | 1.64 | 3.87 | 1.36 | 2.85x |" in text
