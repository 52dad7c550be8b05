"""The grown tree's step against a fixed tree of as many drafts (analysis/grown_steps.py), on made-up stage records."""
import pytest

from analysis.grown_steps import TARGET, grown_step_rows, grown_step_table, verdict
from analysis.results import later_sections

QUESTIONS = [f"q{i}" for i in range(6)]


def method(drafts, step_ms, questions=QUESTIONS, **extra):
    """A heads method whose steps cost step_ms on every question (plus a little spread), 10 steps a question."""
    per_q = {q: {"steps": 10, "decode_time": 10 * step_ms * (1 + 0.01 * i) / 1000} for i, q in enumerate(questions)}
    return {"kind": "heads", "heads": "eagle", "tree_nodes": drafts, "per_question": per_q, **extra}


GROWN = {"grown": {"depth": 3, "top_k": 4, "nodes": 8}}


def rows_of(methods):
    return grown_step_rows({"methods": methods})


def test_a_fixed_tree_of_as_many_drafts_is_read_exactly():
    (row,) = rows_of({"eagle-dynamic_optimal": method(8, 110.0, **GROWN), "eagle-optimal": method(8, 100.0),
                      "eagle-sparse64": method(63, 300.0, QUESTIONS[:2])})
    assert row["how"] == "exact" and [f["method"] for f in row["fixed"]] == ["eagle-optimal"]
    assert row["ratio"] == pytest.approx(1.10) and row["questions"] == 6
    assert row["interval"][0] <= 1.10 <= row["interval"][1]
    assert row["verdict"].startswith("missed")


def test_between_two_fixed_trees_the_fixed_step_is_interpolated_in_drafts():
    (row,) = rows_of({"eagle-dynamic_optimal": method(6, 105.0, **GROWN), "eagle-chain4": method(4, 100.0),
                      "eagle-optimal": method(8, 120.0)})
    assert row["how"] == "interpolated"
    assert [(f["method"], f["weight"]) for f in row["fixed"]] == [("eagle-chain4", 0.5), ("eagle-optimal", 0.5)]
    assert row["ratio"] == pytest.approx(105.0 / 110.0)
    assert row["verdict"] == "met"


def test_trees_merged_with_lookup_or_cut_by_cost_are_not_fixed_trees():
    (row,) = rows_of({"eagle-dynamic_optimal": method(8, 100.0, **GROWN),
                      "eagle-optimal_pld": method(8, 50.0, lookup_branch=True),
                      "eagle-cut": method(8, 50.0, cut_by_cost=True), "eagle-sparse64": method(63, 200.0)})
    assert row["fixed"][0]["method"] == "eagle-sparse64" and row["how"] == "upper bound"


def test_a_one_sided_bound_judges_only_the_side_it_can():
    assert verdict("upper bound", 1.0, [0.9, 1.1]).startswith("not judged")      # a wider fixed step: can only miss
    assert verdict("upper bound", 1.2, [1.1, 1.3]) == "missed"
    assert verdict("lower bound", 1.2, [1.1, 1.3]).startswith("not judged")      # a narrower one: can only meet
    assert verdict("lower bound", 1.0, [0.95, 1.02]) == "met"
    assert verdict("exact", 1.04, [0.98, 1.10]) == f"met (the interval reaches past {TARGET})"


def test_only_the_questions_every_tree_ran_are_read():
    (row,) = rows_of({"eagle-dynamic_optimal": method(6, 105.0, **GROWN), "eagle-chain4": method(4, 100.0, QUESTIONS[:3]),
                      "eagle-optimal": method(8, 120.0)})
    assert row["questions"] == 3


def test_a_family_without_a_grown_or_a_fixed_tree_has_no_row():
    assert rows_of({"eagle-optimal": method(8, 100.0)}) == []
    assert rows_of({"eagle-dynamic_optimal": method(8, 100.0, **GROWN),
                    "hydra-optimal": {**method(8, 100.0), "heads": "hydra"}}) == []


def test_the_results_document_shows_the_table_beside_the_step_costs():
    ms = {"eagle-dynamic_optimal": method(8, 110.0, **GROWN), "eagle-optimal": method(8, 100.0)}
    for m in ms.values():
        for r in m["per_question"].values():
            r.update(decode_tokens=30, base_decode_time=0.8, base_decode_tokens=10, speedup=1.5, accept_length=3.0)
    text = "\n".join(later_sections({"methods": ms}, {}, None, None))
    assert "### The tree grown per step against a fixed tree of as many drafts" in text
    assert grown_step_table(rows_of(ms)).splitlines()[2] in text
