"""python -m pipelines.conformance        (make conformance)    [--questions 8 --new-tokens 64 --repeats 1 ...]

Our decoder judged by the authors' Medusa code (docs/conformance.md), step by step, on the same heads, prompts
and trees. The official code runs in its own environment and process: .venv-conformance (built here on first
use: torch 2.13.0, transformers 4.34.1, medusa-llm 0.1 from PyPI, never a dependency of the project) runs
conformance/official_medusa.py, which prints each fix it applies to the official code and answers request files
with result files (JSON). Two trees: 0.1's medusa_choices=[1, 7, 6] and HEAD's 63-node mc_sim_7b_63 (= our
conf/tree/sparse64.yaml, checked). Two cases:
  golden   heads from a seed (models/methods/medusa/seeded.py seeded_medusa_heads), a few MT-Bench first turns:
           the official steps go to tests/golden/medusa_conformance.json, which tests/test_conformance.py replays
           against our decoder without the old environment;
  trained  results/heads/medusa1 (when trained) exported to the official format: the main comparison.
The runs alternate between the two decoders question by question (the order swapped each time), so machine
drift hits both; reports/conformance.json and reports/conformance.md hold the steps compared, the first
mismatch if any, and tokens/s per decoder and tree (medians over the runs), beside our autoregressive baseline.
"""
from __future__ import annotations

from pipelines import omp  # noqa: F401,I001  (first: OpenMP's wait policy is read when torch loads)
import tempfile
from functools import partial
from pathlib import Path

import yaml

from analysis.conformance import TREE_NAMES, conformance_markdown
from models.engine.drafting import make_drafter
from models.engine.fast_inference import prepare_heads_for_decoding
from models.engine.trees import tree_from_config
from models.methods import export_heads, import_heads
from models.measure.conformance import record_steps
from models.methods.medusa.seeded import medusa_v01_tree, seeded_medusa_heads
from models.hardware import cpu_model
from pipelines.common import REPO_ROOT, write_json
from pipelines.conformance_harness import (Official, decode_both, earlier_cases, interleaved, load_base,
                                           official_env, one_case, parse_args as harness_args, prompts, steps_row,
                                           timing_line, trained_heads, write_golden)

VENV = REPO_ROOT / ".venv-conformance"
OFFICIAL_PACKAGES = (["torch==2.13.0", "transformers==4.34.1"], ["--no-deps", "medusa-llm==0.1"])
RUNNER = REPO_ROOT / "conformance" / "official_medusa.py"
GOLDEN = REPO_ROOT / "tests" / "golden" / "medusa_conformance.json"
GOLDEN_ABOUT = ("per-step tokens (root, then accepted drafts) of the authors' Medusa code (medusa-llm 0.1 + HEAD "
                "e2a5d20 tree code) on heads from a seed; written by `make conformance`")
GOLDEN_TREES = {"v0.1": {"medusa_choices": [1, 7, 6]}, "head63": {"conf_tree": "sparse64"}}
REPORTS = REPO_ROOT / "reports"
TREES = ("v0.1", "head63")          # the runner's names: 0.1's [1, 7, 6] and HEAD's mc_sim_7b_63


def mc_sim_7b_63(official: Official) -> list[tuple]:
    """HEAD's 63-node tree as the Medusa runner reported it."""
    return [tuple(p) for p in official.ready["mc_sim_7b_63"]]


def our_trees(official: Official) -> dict:
    """Our TreeSpecs for the runner's trees; HEAD's list must be conf/tree/sparse64.yaml's."""
    sparse64 = tree_from_config(yaml.safe_load((REPO_ROOT / "conf" / "tree" / "sparse64.yaml").read_text()))
    if sorted(sparse64.paths) != sorted(mc_sim_7b_63(official)):
        raise ValueError("conf/tree/sparse64.yaml is not HEAD's mc_sim_7b_63")
    return {"v0.1": medusa_v01_tree(), "head63": sparse64}


def run_case(name: str, model, tok, heads, prompt_list: list[dict], new_tokens: int, repeats: int, args) -> dict:
    """Both decoders on every prompt and tree, interleaved; -> the case's records and timings."""
    work = Path(tempfile.mkdtemp(prefix=f"conformance-{name}-"))
    export_heads(heads, model, work / "heads-official", "medusa")
    ours_heads = import_heads(work / "heads-official", model, "medusa")   # the very file the official code loads
    prepare_heads_for_decoding(ours_heads, bf16=False)                    # float32, as the official heads
    official = Official(official_env(VENV, OFFICIAL_PACKAGES), RUNNER, "Medusa", work, args.threads,
                        prompt_list[0]["ids"], model=Path(args.model).resolve(), heads=work / "heads-official")
    trees = our_trees(official)
    drafters = {t: make_drafter({"kind": "heads", "tree": spec}, heads=ours_heads) for t, spec in trees.items()}
    for tree in TREES:                  # warm-up, untimed: first-call allocations (0.1's KV cache, our packing)
        official.decode(prompt_list[0]["ids"], 8, tree=tree)
        record_steps(model, drafters[tree], prompt_list[0]["ids"], 8, tok.eos_token_id)
    runs = {t: {"ours": [], "official": []} for t in TREES}
    steps = {t: [] for t in TREES}
    for r, p, order in interleaved(prompt_list, repeats):
        for tree in TREES:
            got = decode_both(order, {
                "official": partial(official.decode, p["ids"], new_tokens, tree=tree),
                "ours": partial(record_steps, model, drafters[tree], p["ids"], new_tokens, tok.eos_token_id)},
                runs[tree])
            if r == 0:
                steps[tree].append({"question_id": p["question_id"], "ours": got["ours"]["steps"],
                                    "official": got["official"]["steps"]})
            print(timing_line(f"{name} {tree} q{p['question_id']} run {r}", order, runs[tree]), flush=True)
    official.close()
    return {"runs": runs, "steps": steps, "mc_sim_7b_63": mc_sim_7b_63(official)}


def summarize(case: dict, base: dict | None, new_tokens: int) -> dict:
    """A report row per tree (conformance_harness.steps_row)."""
    return {tree: steps_row(case["steps"][tree], case["runs"][tree], base, new_tokens) for tree in TREES}


def golden_fields(case: dict) -> dict:
    """What the golden file holds beside its settings and prompts: the trees and the official steps on each."""
    return {"trees": GOLDEN_TREES, "steps": {t: [q["official"] for q in case["steps"][t]] for t in TREES}}


def ensure_assets(args) -> None:
    """The base model and MT-Bench questions, built on first use."""
    if not (REPO_ROOT / args.model).is_dir():
        from pipelines.assets import build_assets
        art = REPO_ROOT / "artifacts"
        build_assets(art, art / "raw" / "ShareGPT_V3_unfiltered_cleaned_split.json",
                     REPO_ROOT / args.questions_file, reuse=True)


def parse_args(argv=None):
    return harness_args(argv, __doc__.split("\n")[2], "results/heads/medusa1", questions=8, new_tokens=64)


def main(argv=None) -> dict:
    args = parse_args(argv)
    ensure_assets(args)
    model, tok = load_base(args)
    report = {"machine": cpu_model(),
              "threads": args.threads, "official": "medusa-llm 0.1 + FasterDecoding/Medusa e2a5d20 tree code, "
              "transformers 4.34.1", "cases": earlier_cases(REPORTS / "conformance.json", args.skip)}
    if "golden" not in args.skip:
        plist = prompts(Path(args.questions_file), args.golden_questions, tok)
        heads = seeded_medusa_heads(model, args.seed, 4, args.scale)
        case, report["cases"]["golden"] = one_case("golden", run_case, summarize, model, tok, heads, plist,
                                                   args.golden_tokens, 1, args, trees=TREE_NAMES)
        report["cases"]["golden"]["heads"] = {"seed": args.seed, "scale": args.scale, "num_heads": 4}
        write_golden(GOLDEN, GOLDEN_ABOUT, {"seed": args.seed, "scale": args.scale, "num_heads": 4,
                                            "max_new_tokens": args.golden_tokens}, plist, golden_fields(case))
    if (trained := trained_heads(args, model)) is not None:
        model_t, heads = trained
        plist = prompts(Path(args.questions_file), args.questions, tok)
        _, report["cases"]["trained"] = one_case("trained", run_case, summarize, model_t, tok, heads, plist,
                                                 args.new_tokens, args.repeats, args, trees=TREE_NAMES)
        report["cases"]["trained"]["heads"] = args.heads
    write_json(REPORTS / "conformance.json", report)
    (REPORTS / "conformance.md").write_text(conformance_markdown(report))
    print(conformance_markdown(report), flush=True)
    return report


if __name__ == "__main__":
    main()
