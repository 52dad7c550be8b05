"""python -m pipelines.conformance_eagle     (make conformance-eagle)    [--questions 3 --new-tokens 32 ...]

Our EAGLE-1 decoder judged by the authors' code (docs/conformance.md), step by step, on the same draft layer,
prompts and static tree. The official code runs in its own environment and process: .venv-conformance-eagle
(built here on first use: torch 2.13.0, transformers 4.36.2, eagle-llm 1.2.1 from PyPI without its
dependencies, never a dependency of the project) runs conformance/official_eagle.py, which prints each fix it
applies to the official code and answers request files with result files (JSON). The tree is the package's
own static tree (eagle.model.choices.mc_sim_7b_63, 25 nodes), which the runner reports and we decode on too.
The draft layer is one file in the authors' format (models/methods/eagle/eagle_format.py write_eagle_module): the
official EaModel loads it, ours reads the same file back (import_heads) and drafts over the full vocabulary with
the base LM head, as the official drafter does. Two cases:
  golden   a layer from a seed (models/methods/eagle/seeded.py seeded_eagle_module), a few MT-Bench first turns:
           the official steps go to tests/golden/eagle_conformance.json, which tests/test_conformance_eagle.py
           replays against our decoder without the old environment;
  trained  results/heads/eagle (when trained), its draft vocabulary dropped (the format has none).
The runs alternate between the two decoders question by question (the order swapped each time);
reports/conformance_eagle.json holds the steps compared, the first mismatch if any, the runner's checks of its
fixes, and tokens/s per decoder (medians over the runs).
"""
from __future__ import annotations

from pipelines import omp  # noqa: F401,I001  (first: OpenMP's wait policy is read when torch loads)
import tempfile
from functools import partial
from pathlib import Path

from models.methods import import_heads
from models.methods.eagle.drafter import EagleDrafter
from models.methods.eagle.eagle_format import write_eagle_module
from models.hardware import cpu_model
from models.measure.conformance import paths_tree, record_steps
from models.methods.eagle.seeded import seeded_eagle_module
from pipelines.common import REPO_ROOT, write_json
from pipelines.conformance_harness import (Official, decode_both, earlier_cases, interleaved, load_base,
                                           official_env, one_case, output_tokens, parse_args as harness_args,
                                           prompts, steps_row, timing_line, trained_heads, write_golden)

VENV = REPO_ROOT / ".venv-conformance-eagle"
OFFICIAL_PACKAGES = (["torch==2.13.0", "transformers==4.36.2"], ["--no-deps", "eagle-llm==1.2.1"])
RUNNER = REPO_ROOT / "conformance" / "official_eagle.py"
GOLDEN = REPO_ROOT / "tests" / "golden" / "eagle_conformance.json"
GOLDEN_ABOUT = ("per-step tokens (root, then accepted drafts) of the authors' EAGLE-1 code (eagle-llm 1.2.1 "
                "EaModel.eagenerate, greedy, its static tree) on a draft layer from a seed; written by "
                "`make conformance-eagle`")
REPORT = REPO_ROOT / "reports" / "conformance_eagle.json"
TREE = "eagle_mc_sim_7b_63"


def run_case(name: str, model, tok, module, prompt_list: list[dict], new_tokens: int, repeats: int, args) -> dict:
    """Both decoders on every prompt, interleaved; -> the case's records, timings, tree and the runner's checks."""
    work = Path(tempfile.mkdtemp(prefix=f"conformance-eagle-{name}-"))
    write_eagle_module(module, model, work / "eagle-official")
    ours = import_heads(work / "eagle-official", model, "eagle").eagle   # the very file the official code loads
    official = Official(official_env(VENV, OFFICIAL_PACKAGES), RUNNER, "EAGLE", work, args.threads,
                        prompt_list[0]["ids"], model=Path(args.model).resolve(), eagle=work / "eagle-official")
    tree = [list(p) for p in official.ready["tree"]]
    drafter = EagleDrafter(ours, paths_tree(TREE, tree))
    official.decode(prompt_list[0]["ids"], 8)                         # warm-up, untimed
    record_steps(model, drafter, prompt_list[0]["ids"], 8, tok.eos_token_id)
    runs, steps = {"ours": [], "official": []}, []
    for r, p, order in interleaved(prompt_list, repeats):
        got = decode_both(order, {
            "official": partial(official.decode, p["ids"], new_tokens),
            "ours": partial(record_steps, model, drafter, p["ids"], new_tokens, tok.eos_token_id)}, runs)
        if r == 0:
            steps.append({"question_id": p["question_id"], "ours": got["ours"]["steps"],
                          "official": got["official"]["steps"]})
        print(timing_line(f"{name} q{p['question_id']} run {r}", order, runs), flush=True)
    official.close()
    return {"runs": runs, "steps": steps, "tree": tree, "checks": official.ready["checks"]}


def summarize(case: dict, base: dict | None, new_tokens: int) -> dict:
    """The report row of the one tree (conformance_harness.steps_row), with the steps that matched and the runner's
    checks of its fixes."""
    return steps_row(case["steps"], case["runs"], base, new_tokens, count_identical=True,
                     official_checks=case["checks"])


def golden_fields(case: dict) -> dict:
    """What the golden file holds beside its settings and prompts: the official steps and the tokens they make."""
    return {"steps": [q["official"] for q in case["steps"]],
            "output_tokens": [output_tokens(q["official"]) for q in case["steps"]]}


def parse_args(argv=None):
    return harness_args(argv, __doc__.split("\n")[2], "results/heads/eagle", questions=3, new_tokens=32)


def main(argv=None) -> dict:
    args = parse_args(argv)
    model, tok = load_base(args)
    report = {"machine": cpu_model(), "threads": args.threads,
              "official": "eagle-llm 1.2.1 (eagle.model.EaModel.eagenerate), transformers 4.36.2",
              "cases": earlier_cases(REPORT, args.skip)}
    if "golden" not in args.skip:
        plist = prompts(Path(args.questions_file), args.golden_questions, tok)
        module = seeded_eagle_module(model, args.seed, args.scale)
        case, report["cases"]["golden"] = one_case("golden", run_case, summarize, model, tok, module, plist,
                                                   args.golden_tokens, 1, args)
        report["cases"]["golden"]["eagle"] = {"seed": args.seed, "scale": args.scale}
        settings = {"seed": args.seed, "scale": args.scale, "max_new_tokens": args.golden_tokens,
                    "threads": args.threads, "tree": {"name": TREE, "paths": case["tree"]}}
        write_golden(GOLDEN, GOLDEN_ABOUT, settings, plist, golden_fields(case))
    if (trained := trained_heads(args, model)) is not None:
        model_t, heads = trained          # its draft vocabulary dropped: the authors' format has none
        plist = prompts(Path(args.questions_file), args.questions, tok)
        _, report["cases"]["trained"] = one_case("trained", run_case, summarize, model_t, tok, heads.draft_module,
                                                 plist, args.new_tokens, args.repeats, args)
        report["cases"]["trained"]["eagle"] = args.heads
    write_json(REPORT, report)
    print(f"wrote {REPORT.relative_to(REPO_ROOT)}", flush=True)
    return report


if __name__ == "__main__":
    main()
