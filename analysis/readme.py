"""python -m analysis.readme

The README's headline table, made from the committed metrics: the DVC chains' reports/metrics/references.json
with evaluate_<family>.json of each family (each method over its own stage's baseline) where references.json is
there, else the one-process run's evaluate.json, and the runs of one method each (evaluate_<run>.json) beneath it:
the block between the two markers below is rewritten, nothing else. tests/test_readme.py fails when the README and
the metrics disagree.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from analysis.comparisons import FAMILY_LABELS, HF_GENERATE, HF_GENERATE_LABEL, faster_ar_loop

REPO_ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- headline: written by `python -m analysis.readme` -->", "<!-- /headline -->"
TREES = {"optimal": "calibrated tree", "optimal_pld": "calibrated tree + prompt lookup",
         "dynamic_optimal": "tree grown per step", "dynamic_optimal_pld": "tree grown per step + prompt lookup"}
LOOKUPS = {"pld": "prompt lookup (this decoder)", "pld_hf": "prompt lookup (transformers)"}


def _cell(value: float | None, ci: list | None, unit: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:.2f}{unit}" + (f" ({ci[0]:.2f} to {ci[1]:.2f})" if ci else "")


PEERS = LOOKUPS | {"sps_hf": "draft model (transformers' assisted generation)", HF_GENERATE: HF_GENERATE_LABEL}


def method_label(name: str) -> str:
    """A method's name in the metrics ("hydra-optimal_pld", "pld", ...) in words."""
    if name in PEERS:
        return PEERS[name]
    family, _, tree = name.partition("-")
    return f"{FAMILY_LABELS.get(family, family)}, {TREES.get(tree, tree)}" if tree else name


def run_rows(single_runs: dict[str, dict]) -> list[tuple[str, str, dict]]:
    """(run, method label, its metrics) for every method of each run of one method except its baseline: the
    method, the trees it also ran (eval.selected_trees) and the peers it ran beside."""
    rows = []
    for tag, run in sorted(single_runs.items()):
        methods = run.get("methods", {})
        drafted = [n for n in methods if not n.startswith("baseline") and n not in PEERS]
        order = sorted(drafted, key=lambda n: (n != tag, n)) + [n for n in PEERS if n in methods]
        rows += [(tag, method_label(n), methods[n]) for n in order]
    return rows


def headline_rows(metrics: dict) -> list[tuple[str, dict]]:
    methods = metrics.get("methods", {})
    rows = [(HF_GENERATE_LABEL, methods[HF_GENERATE])] if HF_GENERATE in methods else []
    rows += [(label, methods[name]) for name, label in LOOKUPS.items() if name in methods]
    for family, flabel in FAMILY_LABELS.items():
        for tree, tlabel in TREES.items():
            name = f"{family}-{tree}"
            if name in methods:
                rows.append((f"{flabel}, {tlabel}", methods[name]))
    return rows


def ties_note(metrics: dict) -> str:
    """", up to N float ties (...)" when the run reported ties (models/measure/lossless.py), else nothing."""
    summary = metrics.get("lossless_summary") or "lossless"
    return "" if summary == "lossless" else ", " + summary.removeprefix("lossless ")


def ar_loops(metrics: dict) -> tuple[str, float]:
    """(", transformers' greedy generate Y tokens/s: <the faster loop> ..." after the baseline's tokens/s, the factor
    that turns a speedup over the baseline into one over the faster loop): ("", 1.0) without an hf_generate row."""
    hf = (metrics.get("methods") or {}).get(HF_GENERATE)
    base, hf_tps = metrics.get("baseline_tokens_per_s"), (hf or {}).get("tokens_per_s")
    if not hf or not base or not hf_tps:
        return "", 1.0
    faster, factor = faster_ar_loop(base, hf_tps)
    text = f", transformers' greedy generate {hf_tps:.1f} tokens/s: "
    if faster == HF_GENERATE:
        return text + ("transformers' is the faster autoregressive loop on this machine, so the last column gives "
                       f"each speedup over it (the speedup over the baseline x {factor:.2f})"), factor
    return text + "the baseline is the faster autoregressive loop on this machine, so the speedups over it stand", 1.0


def headline_block(metrics: dict, single_runs: dict[str, dict] | None = None) -> str:
    loops, factor = ar_loops(metrics)
    over = factor != 1.0                 # transformers' loop is the faster: a column over it
    lines = [START, "",
             f"{metrics.get('num_questions')} MT-Bench questions, {metrics.get('max_new_tokens')} new tokens, greedy, "
             f"batch 1; the baseline decoded {metrics.get('baseline_tokens_per_s', 0):.1f} tokens/s{loops}. Speedup: "
             "mean per-question tokens/s over the baseline's (Spec-Bench), with its 95% bootstrap interval over "
             f"questions. Lossless: {'every' if metrics.get('lossless') else 'NOT every'} one of "
             f"{metrics.get('lossless_checked_turns')} greedy answers equals the baseline's token for token"
             f"{ties_note(metrics)}.", "",
             "| method | questions | speedup (95% interval) | accepted tokens a step (95% interval) |"
             + (" speedup over the faster loop |" if over else ""),
             "|---|---|---|---|" + ("---|" if over else "")]
    for label, m in headline_rows(metrics):
        extra = f" {_cell(m['speedup'] * factor, None, 'x')} |" if over and m.get("speedup") is not None else \
            " - |" if over else ""
        lines.append(f"| {label} | {m.get('questions')} | {_cell(m.get('speedup'), m.get('speedup_ci'), 'x')} | "
                     f"{_cell(m.get('accept_length'), m.get('accept_length_ci'))} |{extra}")
    own = run_rows(single_runs or {})
    if own:
        m2 = ("; Medusa-2's decodes the heads of the committed `train_medusa2.json`"
              if any(tag == "medusa2-optimal" for tag, _, _ in own) else "")
        lines += ["", "Methods run on their own after the main run (`reports/metrics/evaluate_<run>.json`), each speedup "
                  f"over the baseline of its own run, beside the peers that run also measured{m2}:", "",
                  "| run | method | questions | speedup (95% interval) | accepted tokens a step (95% interval) |",
                  "|---|---|---|---|---|"]
        lines += [f"| {tag} | {label} | {m.get('questions')} | {_cell(m.get('speedup'), m.get('speedup_ci'), 'x')} | "
                  f"{_cell(m.get('accept_length'), m.get('accept_length_ci'))} |" for tag, label, m in own]
    return "\n".join(lines + ["", END])


def single_runs(folder: Path = REPO_ROOT / "reports" / "metrics") -> dict[str, dict]:
    """{run: reports/metrics/evaluate_<run>.json} of the methods run on their own (not the chains' evaluate@<family>)."""
    return {p.stem[len("evaluate_"):]: json.loads(p.read_text()) for p in sorted(folder.glob("evaluate_*.json"))
            if p.stem[len("evaluate_"):] not in FAMILY_LABELS}


def headline_metrics(folder: Path = REPO_ROOT / "reports" / "metrics") -> dict:
    """The metrics the headline shows: references.json with every family's evaluate_<family>.json methods merged in
    (the DVC chains), or evaluate.json (one process) where there is no references.json."""
    refs = folder / "references.json"
    if not refs.is_file():
        return json.loads((folder / "evaluate.json").read_text())
    merged = json.loads(refs.read_text())
    for family in FAMILY_LABELS:
        path = folder / f"evaluate_{family}.json"
        if path.is_file():
            run = json.loads(path.read_text())
            merged["methods"].update(run["methods"])
            merged["lossless"] = merged["lossless"] and run["lossless"]
            merged["lossless_checked_turns"] += run["lossless_checked_turns"]
    return merged


def refresh(readme: str, metrics: dict, runs: dict[str, dict] | None = None) -> str:
    """readme with its headline block replaced; a README without the markers is an error, not a silent no-op."""
    if START not in readme or END not in readme:
        raise ValueError(f"README has no headline block: expected a line {START!r} and a line {END!r}")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return head + headline_block(metrics, runs) + tail


def main(argv: list[str]) -> None:
    readme = REPO_ROOT / "README.md"
    text = refresh(readme.read_text(), headline_metrics(), single_runs())
    if text != readme.read_text():
        readme.write_text(text)
        print("README.md: headline table rewritten from reports/metrics/")


if __name__ == "__main__":
    main(sys.argv[1:])
