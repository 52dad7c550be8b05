"""The papers' tables with our numbers beside the published ones, as Markdown and LaTeX.

    python -m pipelines.tables            (the stage; this module is the library)

    summary = load_summary("results/eval/all/summary.json")
    tables = build_tables(summary, calibrations=load_calibrations("results/calibrate"),   # analysis/render.py
                          single_runs=single_runs(Path("reports/metrics")))    # analysis.readme.single_runs
    text = to_markdown(tables["hydra"]);  tex = to_latex(tables["hydra"])      # analysis/render.py

Input: the summary written by `pipelines.evaluate` (results/eval/<tag>/summary.json):

    {"tag": "all", "model": "SmolLM2-135M-Instruct", "hardware": "2-core CPU (x86_64)", "profile": "cpu",
     "settings": {"turns": 1, "max_new_tokens": 64, "repeats": 1, "temperature_mode": "greedy", ...},
     "baseline": "baseline",
     "methods": {"<method id>": {
         "kind": "baseline" | "heads" | "pld" | "pld_hf" | "reference",
         "heads": "medusa1" | ... | null, "family": "medusa" | ... | null,
         "tree": "sparse64" | ... | null, "tree_nodes": 63 | null,
         "speedup": {"mean", "std", "runs"}, "decode_speedup": {...}, "throughput": {...},
         "decode_throughput": {...}, "accept_length": {...},
         "per_category": {"writing": {"speedup": {...}, "throughput": {...}, "accept_length": {...}}, ...},
         "accept_length_histogram": {"1": count, "2": count, ...}, "new_tokens", "wall_time", "steps", "turns",
         "questions": 8, "pld_speedups": {"pld": 0.9, "pld_hf": 0.8}}}}   (the PLDs on this method's questions)

Every row says where its numbers come from: "<model>, <hardware> (paper | Spec-Bench | ours)". A method
that ran on a subset of the questions (profile.eval.tree_questions) gets a footnote in every table it is in.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from analysis.published import published_models, published_value

CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
MEDUSA_COLUMNS = (("medusa1", "Medusa-1"), ("medusa2", "Medusa-2"))
HYDRA_COLUMNS = (("medusa1", "Medusa"), ("hydra", "Hydra"), ("hydra_pp", "Hydra++"), ("pld", "PLD"),
                 ("pld_hf", "PLD (transformers)"))
EAGLE_COLUMNS = (("eagle", "EAGLE"), ("eagle2", "EAGLE-2"), ("eagle3", "EAGLE-3"), ("sps", "SpS"), ("hydra", "Hydra"),
                 ("medusa1", "Medusa-1"), ("pld", "PLD"))
EAGLE_PUBLISHED = ("specbench_2025", "eagle3")        # analysis/published.py tables, in the order shown
EAGLE_FAMILIES = ("eagle", "eagle3", "sps")            # a run of one method is shown when it ran one of these
# our rows: the calibrated tree alone and with prompt lookup merged in; EAGLE-2 (ours) is the EAGLE heads on the
# calibrated tree grown per step (conf/tree/dynamic_optimal.yaml, dynamic_optimal_pld.yaml), or where that did not
# run on the tree cut per step by cost that starts from the calibrated tree (conf/tree/cut.yaml, cut_pld.yaml)
EAGLE2_TREES = {"optimal": "dynamic_optimal", "optimal_pld": "dynamic_optimal_pld"}
EAGLE2_CUT_TREES = {"optimal": "cut", "optimal_pld": "cut_pld"}
PLD_KINDS = ("pld", "pld_hf")


@dataclass
class Table:
    name: str
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def load_summary(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; run `python -m pipelines.evaluate` (or `dvc repro evaluate`)")
    summary = json.loads(path.read_text())
    for key in ("model", "hardware", "methods"):
        if key not in summary:
            raise ValueError(f"{path} is not an evaluate summary: no {key!r} key")
    return summary


def load_calibrations(folder: str | Path) -> dict[str, dict]:
    """{heads name: calibration.json content} for every results/calibrate/<name>/calibration.json."""
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(Path(folder).glob("*/calibration.json"))}


# -- formatting ------------------------------------------------------------------------------
def fmt_speedup(stat, published: bool = False) -> str:
    if stat is None:
        return "-"
    if published:
        return f"{stat:.2f}x"
    if stat.get("mean") is None:
        return "-"
    std = f" ± {stat['std']:.2f}" if len(stat.get("runs", [])) > 1 else ""
    return f"{stat['mean']:.2f}x{std}"


def fmt_length(stat, published: bool = False) -> str:
    if stat is None:
        return "-"
    if published:
        return f"{stat:.2f}"
    return "-" if stat.get("mean") is None else f"{stat['mean']:.2f}"


def fmt_interval_of(m: dict, key: str, unit: str = "x") -> str:
    """"1.28x (1.22-1.34)": a method's figure with its 95% bootstrap interval over questions (from
    m["intervals"]); the plain figure when the summary has no interval."""
    iv = (m.get("intervals") or {}).get(key) or {}
    if iv.get("value") is None:
        return fmt_speedup(m.get(key)) if unit == "x" else fmt_length(m.get(key))
    ci = iv.get("ci")
    return f"{iv['value']:.2f}{unit}" + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else "")


def fmt_rate(stat) -> str:
    return "-" if stat is None or stat.get("mean") is None else f"{stat['mean']:.1f}"


def ours_label(summary: dict, tree: str | None = None) -> str:
    tree_part = f", tree {tree}" if tree else ""
    return f"{summary['model']}, {summary['hardware']} (ours{tree_part})"


def method_trees(summary: dict) -> list[str]:
    """Trees of the head methods, in the order they were evaluated."""
    return list(dict.fromkeys(m["tree"] for m in summary["methods"].values() if m["kind"] == "heads"))


def find_method(summary: dict, heads: str, tree: str | None) -> dict | None:
    """The method entry for a heads name on a tree ("pld" / "pld_hf" match the prompt lookups, any tree)."""
    for m in summary["methods"].values():
        if heads in PLD_KINDS and m["kind"] == heads:
            return m
        if m["kind"] == "heads" and m.get("heads") == heads and m.get("tree") == tree:
            return m
    return None


def subset_notes(summary: dict, methods: list[dict] | None = None) -> list[str]:
    """"sparse64: 4 of 8 questions ..." for the trees whose methods ran on fewer questions than the run."""
    total = summary.get("settings", {}).get("num_questions")
    by_tree = {}
    for m in methods if methods is not None else summary["methods"].values():
        if m.get("kind") == "heads" and total and m.get("questions") and m["questions"] < total:
            by_tree.setdefault(m["tree"], m["questions"])
    return [f"{tree}: {n} of {total} questions (spread over the categories); its speedups compare it with the "
            "baseline on those questions." for tree, n in by_tree.items()]


def stronger_pld(m: dict) -> tuple[str, float] | None:
    """(name, speedup) of the faster prompt lookup on this method's own questions."""
    plds = {k: v for k, v in (m.get("pld_speedups") or {}).items() if v is not None}
    return max(plds.items(), key=lambda kv: kv[1]) if plds else None


def categories_ahead_of_pld(summary: dict, m: dict) -> str:
    """"won/of": the MT-Bench categories (of those the method ran on) where its mean end-to-end speedup is above
    both prompt lookups'; "-" without them. One mean can hide where a method wins: on the cpu profile prompt
    lookup's average is mostly one extraction question, where it copies the text."""
    plds = [summary["methods"][k].get("per_category") or {} for k in ("pld", "pld_hf") if k in summary["methods"]]
    cats = {c: v["speedup"]["mean"] for c, v in (m.get("per_category") or {}).items() if v["speedup"]["mean"] is not None}
    rivals = {c: [p[c]["speedup"]["mean"] for p in plds if c in p and p[c]["speedup"]["mean"] is not None] for c in cats}
    judged = {c: v for c, v in cats.items() if rivals[c]}
    if not judged:
        return "-"
    return f"{sum(v > max(rivals[c]) for c, v in judged.items())}/{len(judged)}"


# -- the tables ------------------------------------------------------------------------------
def medusa_table(summary: dict) -> Table:
    t = Table("medusa", "Medusa: speedup over autoregressive decoding on MT-Bench (batch 1)",
              ["Base model", "Measured on", *[c for _, c in MEDUSA_COLUMNS]])
    for model in published_models("medusa"):
        cells = [published_value("medusa", model, m) for m, _ in MEDUSA_COLUMNS]
        where = next(c for c in cells if c is not None)
        t.rows.append([model, where.label, *[fmt_speedup(c.value if c else None, True) for c in cells]])
    for tree in method_trees(summary):
        ms = [find_method(summary, m, tree) for m, _ in MEDUSA_COLUMNS]
        t.rows.append([summary["model"], ours_label(summary, tree), *[fmt_speedup(m["speedup"] if m else None) for m in ms]])
    t.notes.append("Published: Medusa paper/repo, A100. Ours: same process, methods back to back per question; "
                   "end to end (prefill included), as published.")
    t.notes += subset_notes(summary)
    return t


def published_rows(tables, columns) -> list[list[str]]:
    """One row per base model of each published table: the model, where it was measured, and "speedup / accepted"
    for each of `columns` ((method, label) pairs; "-" where the source has no figure)."""
    rows = []
    for table in tables:
        for model in published_models(table):
            cells = []
            for method, _ in columns:
                sp = published_value(table, model, method, "speedup")
                al = published_value(table, model, method, "accept_length")
                cells.append("-" if sp is None else f"{fmt_speedup(sp.value, True)} / {fmt_length(al.value if al else None, True)}")
            where = next(c for c in [published_value(table, model, m) for m, _ in columns] if c is not None)
            rows.append([model, where.label, *cells])
    return rows


def hydra_table(summary: dict) -> Table:
    t = Table("hydra", "Hydra: speedup / mean accepted tokens per step on MT-Bench (greedy, batch 1)",
              ["Base model", "Measured on", *[c for _, c in HYDRA_COLUMNS]])
    t.rows += published_rows(("hydra", "specbench"), HYDRA_COLUMNS)
    for tree in method_trees(summary):
        cells = []
        for method, _ in HYDRA_COLUMNS:
            m = find_method(summary, method, tree)
            cells.append("-" if m is None else f"{fmt_speedup(m['speedup'])} / {fmt_length(m['accept_length'])}")
        t.rows.append([summary["model"], ours_label(summary, tree), *cells])
    t.notes.append("Hydra paper: 63-node tree (sparse64 here). Spec-Bench: Vicuna-7B, A100. PLD = prompt lookup "
                   "decoding, tree-independent: ours in the heads' decoder (same loop and step) and transformers' "
                   "generate(prompt_lookup_num_tokens). Speedups end to end (prefill included), as published.")
    t.notes += subset_notes(summary)
    return t


def _pair(speedup, accept) -> str:
    """"1.54x / 2.07" from a run of one method's plain figures (reports/metrics/evaluate_<tag>.json)."""
    return "-" if speedup is None else f"{speedup:.2f}x / " + ("-" if accept is None else f"{accept:.2f}")


def eagle2_method(summary: dict, tree: str) -> dict | None:
    """Ours for EAGLE-2: the EAGLE heads on their tree grown per step, else on a tree cut per step by cost, with
    prompt lookup merged in or not as `tree` is (EAGLE2_TREES, EAGLE2_CUT_TREES name the trees; any other cut tree
    of the same kind counts too)."""
    for trees in (EAGLE2_TREES, EAGLE2_CUT_TREES):
        named = find_method(summary, "eagle", trees[tree])
        if named is not None:
            return named
    lookup = tree.endswith("_pld")
    return next((m for m in summary["methods"].values() if m["kind"] == "heads" and m.get("heads") == "eagle"
                 and m.get("cut_by_cost") and bool(m.get("lookup_branch")) == lookup), None)


def eagle_table(summary: dict, single_runs: dict[str, dict] | None = None) -> Table:
    """EAGLE, EAGLE-2, EAGLE-3 and the draft model beside Hydra, Medusa-1 and prompt lookup: Spec-Bench's leaderboard
    (commit fd2c1cd) and the EAGLE-3 paper, then ours from the main run and from the runs of one method each
    (single_runs: {tag: reports/metrics/evaluate_<tag>.json}), on the calibrated tree alone and with prompt
    lookup merged in."""
    t = Table("eagle", "EAGLE and draft models: speedup / mean accepted tokens per step on MT-Bench (greedy, batch 1)",
              ["Base model", "Measured on", *[c for _, c in EAGLE_COLUMNS]])
    t.rows += published_rows(EAGLE_PUBLISHED, EAGLE_COLUMNS)
    heads_columns = [m for m, _ in EAGLE_COLUMNS if m not in PLD_KINDS]
    shown = []
    for tree in EAGLE2_TREES:                          # the main run
        ms = {m: eagle2_method(summary, tree) if m == "eagle2" else find_method(summary, m, tree) for m, _ in EAGLE_COLUMNS}
        if not any(ms[m] for m in heads_columns):
            continue
        shown += [m for m in ms.values() if m]
        t.rows.append([summary["model"], ours_label(summary, tree),
                       *["-" if m is None else f"{fmt_speedup(m['speedup'])} / {fmt_length(m['accept_length'])}"
                         for m in ms.values()]])
    runs = []
    for tag, run in sorted((single_runs or {}).items()):      # the runs of one method each
        methods = run.get("methods") or {}
        for tree, cut in EAGLE2_TREES.items():
            names = {m: ("pld" if m in PLD_KINDS else f"eagle-{cut}" if m == "eagle2" else f"{m}-{tree}")
                     for m, _ in EAGLE_COLUMNS}
            if not any(names[f] in methods for f in (*EAGLE_FAMILIES, "eagle2")):
                continue
            runs.append(tag)
            t.rows.append([summary["model"], f"{summary['model']}, {summary['hardware']} (ours, run {tag}, tree {tree})",
                           *[_pair(methods[n].get("speedup"), methods[n].get("accept_length")) if n in methods else "-"
                             for n in names.values()]])
    t.notes.append("Spec-Bench fd2c1cd: its leaderboard at that commit (A100 80 GB; SpS drafts with a 68M model; the "
                   "earlier leaderboard's figures are in the Hydra table). EAGLE-3 paper: no device named; its Medusa "
                   "is Medusa-1. Speedups end to end (prefill included), as published.")
    t.notes.append("Ours, tree optimal: the calibrated tree of each head family (conf/tree/optimal.yaml); tree "
                   "optimal_pld: the same with prompt lookup's chain merged in (conf/tree/optimal_pld.yaml). EAGLE-2 "
                   "(ours): the EAGLE heads on tree=dynamic_optimal (dynamic_optimal_pld in the optimal_pld rows), "
                   "EAGLE-2's tree grown at every step from the drafter's own probabilities, its depth, top_k and "
                   "nodes calibrated on this machine; where that did not run, tree=cut (cut_pld), the "
                   "calibrated 16-node tree cut at every step by cost. SpS (ours): the two-layer draft model of "
                   "conf/heads/sps.yaml. PLD (ours): prompt lookup in the heads' decoder, tree-independent. "
                   "-: not run.")
    if runs:
        t.notes.append("Rows \"ours, run X\": methods run on their own (reports/metrics/evaluate_X.json), each speedup "
                       "over the baseline of its own run: compare within a row, not with the main run's rows.")
    t.notes += subset_notes(summary, shown)
    return t


def tree_nodes(m: dict) -> str:
    """Nodes of a method's tree; "<= n" for a tree cut per step by cost (conf/tree/cut.yaml), "+ lookup" for
    one with prompt lookup's chain merged in (conf/tree/optimal_pld.yaml)."""
    n = m.get("tree_nodes")
    if not n:
        return "-"
    size = f"<= {n}" if m.get("cut_by_cost") else f"{n} grown" if m.get("grown") else str(n)
    return size + (" + lookup" if m.get("lookup_branch") else "")


def speed_table(summary: dict) -> Table:
    """Every method's end-to-end and decode-only speedup, and how it compares with the stronger prompt lookup."""
    s = summary.get("settings", {})
    t = Table("speed", "Speedup end to end and decode-only, against the stronger prompt lookup (ours)",
              ["Method", "Tree nodes", "Questions", "End to end", "Decode-only", "Accepted tokens/step",
               "Tokens/s", "Decode tokens/s", "vs stronger PLD", "Categories ahead of PLD"])
    for name, m in summary["methods"].items():
        if m["kind"] == "reference":
            continue
        best = stronger_pld(m) if m["kind"] == "heads" else None
        mean = m["speedup"].get("mean")
        versus = "-" if best is None or mean is None or not best[1] else f"{mean / best[1]:.2f}x ({best[0]})"
        t.rows.append([name, tree_nodes(m), str(m.get("questions") or "-"),
                       fmt_interval_of(m, "speedup"), fmt_interval_of(m, "decode_speedup"),
                       fmt_interval_of(m, "accept_length", unit=""),
                       fmt_rate(m["throughput"]), fmt_rate(m.get("decode_throughput")), versus,
                       categories_ahead_of_pld(summary, m) if m["kind"] == "heads" else "-"])
    t.notes.append(f"{ours_label(summary)}, {s.get('max_new_tokens')} new tokens per turn. In brackets: 95% bootstrap "
                   "interval over questions. End to end: per "
                   "question, new tokens / wall time (prefill included), over the baseline's; decode-only: new tokens "
                   "after the first / time after the prefill, over the baseline's; both averaged over questions "
                   "(Spec-Bench). vs stronger PLD: end-to-end speedup over that of the faster prompt lookup (pld: "
                   "ours, pld_hf: transformers') on the same questions; above 1.00x beats prompt lookup. Categories ahead of "
                   "PLD: the MT-Bench categories (of those the method ran on) where its mean end-to-end speedup is above "
                   "both prompt lookups' means there.")
    t.notes += subset_notes(summary)
    return t


def category_table(summary: dict) -> Table:
    cats = [c for c in CATEGORIES if any(c in m.get("per_category", {}) for m in summary["methods"].values())]
    t = Table("category", "Speedup per MT-Bench category (ours)", ["Method", "Measured on", *cats, "overall"])
    for name, m in summary["methods"].items():
        if m["kind"] not in ("heads", *PLD_KINDS):
            continue
        per = m.get("per_category", {})
        t.rows.append([name, ours_label(summary), *[fmt_speedup(per.get(c, {}).get("speedup")) for c in cats],
                       fmt_speedup(m["speedup"])])
    t.notes.append("The papers publish no per-category speedups for these methods; only ours are shown.")
    t.notes += subset_notes(summary)
    return t
