"""The front page and the docs stay true: the README's headline table is the committed metrics', the
repository cites only its own files, and every `docs/<file>.md#<section>` a docstring cites exists."""
from __future__ import annotations

import json
import re
import subprocess

import pytest

from analysis.readme import END, REPO_ROOT, START, headline_block, headline_metrics, refresh, single_runs


def tracked_text_files() -> list:
    out = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.yaml", "*.toml", "Makefile"], cwd=REPO_ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [REPO_ROOT / p for p in out if (REPO_ROOT / p).is_file()]


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_headline_table_is_the_committed_metrics():
    readme = (REPO_ROOT / "README.md").read_text()
    block = readme[readme.index(START):readme.index(END) + len(END)]
    assert block == headline_block(headline_metrics(), single_runs()), (
        "README's headline table differs from reports/metrics/: run `python -m analysis.readme`")


def test_the_chains_metrics_make_one_headline_and_are_not_runs_of_one_method(tmp_path):
    """references.json and each family's evaluate_<family>.json (the DVC chains) make the headline, each method's
    figures as its own stage measured them; a run by hand (evaluate_<heads>-<tree>.json) stays beneath it."""
    row = {"questions": 2, "speedup": 1.2, "speedup_ci": [1.1, 1.3], "accept_length": 1.5, "accept_length_ci": None}
    head = {"num_questions": 2, "max_new_tokens": 8, "baseline_tokens_per_s": 10.0}
    files = {"references": {**head, "lossless": True, "lossless_checked_turns": 4, "methods": {"pld": row}},
             "evaluate_hydra": {**head, "lossless": True, "lossless_checked_turns": 6,
                                "methods": {"hydra-optimal": {**row, "speedup": 1.1},
                                            "hydra-dynamic_optimal_pld": {**row, "speedup": 1.4}}},
             "evaluate_hydra-chain4": {**head, "methods": {"hydra-chain4": row}}}
    for stem, body in files.items():
        (tmp_path / f"{stem}.json").write_text(json.dumps(body))
    metrics = headline_metrics(tmp_path)
    assert set(metrics["methods"]) == {"pld", "hydra-optimal", "hydra-dynamic_optimal_pld"}
    assert metrics["lossless_checked_turns"] == 10
    assert metrics["methods"]["hydra-optimal"]["speedup"] == 1.1 and metrics["lossless"]
    assert set(single_runs(tmp_path)) == {"hydra-chain4"}
    block = headline_block(metrics, single_runs(tmp_path))
    assert "| Hydra, calibrated tree | 2 | 1.10x (1.10 to 1.30) | 1.50 |" in block
    assert "| Hydra, tree grown per step + prompt lookup | 2 | 1.40x (1.10 to 1.30) | 1.50 |" in block


def test_the_readme_is_a_front_page():
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; run-specific text belongs in reports/results.md"
    for doc in re.findall(r"`(docs/[\w.-]+\.md)`", "\n".join(lines)):
        assert (REPO_ROOT / doc).is_file(), f"README names {doc}, which does not exist"


def test_refresh_replaces_only_the_block_and_refuses_a_readme_without_one():
    metrics = {"num_questions": 2, "max_new_tokens": 8, "baseline_tokens_per_s": 10.0, "lossless": True,
               "lossless_checked_turns": 6, "methods": {
                   "pld": {"questions": 2, "speedup": 1.5, "speedup_ci": [1.2, 1.8], "accept_length": 1.4,
                           "accept_length_ci": [1.3, 1.5]},
                   "hydra-optimal": {"questions": 2, "speedup": 1.1, "speedup_ci": None, "accept_length": 1.6,
                                     "accept_length_ci": [1.5, 1.7]}}}
    text = refresh(f"before\n{START}\nold\n{END}\nafter\n", metrics)
    row = {"questions": 2, "speedup": 1.2, "speedup_ci": [1.1, 1.3], "accept_length": 1.5, "accept_length_ci": None}
    own = {"medusa2-optimal": {"methods": {"medusa2-optimal": row}},
           "eagle-optimal_pld": {"methods": {"baseline-eagle": row, "pld": row, "eagle-optimal": row,
                                             "eagle-optimal_pld": row}}}
    block = refresh(f"{START}\n{END}", metrics, own)
    assert "| medusa2-optimal | Medusa-2, calibrated tree | 2 | 1.20x (1.10 to 1.30) | 1.50 |" in block
    # a run's own method first, then the trees it also ran, then its peers; never its baseline
    assert [line.split(" | ")[1] for line in block.splitlines() if line.startswith("| eagle-optimal_pld")] == [
        "EAGLE, calibrated tree + prompt lookup", "EAGLE, calibrated tree", "prompt lookup (this decoder)"]
    assert "on their own" not in text
    assert text.startswith("before\n") and text.endswith("\nafter\n") and "old" not in text
    assert "| prompt lookup (this decoder) | 2 | 1.50x (1.20 to 1.80) | 1.40 (1.30 to 1.50) |" in text
    assert "| Hydra, calibrated tree | 2 | 1.10x | 1.60 (1.50 to 1.70) |" in text
    with pytest.raises(ValueError, match="headline block"):
        refresh("no markers here\n", metrics)


def test_no_file_cites_anything_outside_the_repository():
    pattern = re.compile(r"REFERENCE\.md|DESIGN\.md|\.\./shared")
    offenders = [f"{p.relative_to(REPO_ROOT)}:{i}" for p in tracked_text_files() if p.name != "test_readme.py"
                 for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if pattern.search(line)]
    assert not offenders, f"cites files outside the repository: {offenders}"


def test_every_cited_docs_section_exists():
    cited = re.compile(r"docs/([\w-]+\.md)#([\w-]+)")
    missing = []
    for p in tracked_text_files():
        for doc, anchor in cited.findall(p.read_text(errors="replace")):
            target = REPO_ROOT / "docs" / doc
            headings = [slug(line.lstrip("#")) for line in target.read_text().splitlines()
                        if line.startswith("#")] if target.is_file() else []
            if anchor not in headings:
                missing.append(f"{p.relative_to(REPO_ROOT)}: docs/{doc}#{anchor}")
    assert not missing, f"cited sections that do not exist: {missing}"
