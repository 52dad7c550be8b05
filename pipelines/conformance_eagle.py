"""python -m pipelines.conformance_eagle     (make conformance-eagle)    [--questions 3 --new-tokens 32 ...]

Our EAGLE-1 decoder judged by the authors' code (docs/conformance.md), step by step, on the same draft layer,
prompts and static tree. The official code runs in its own environment and process: .venv-conformance-eagle
(built here on first use: torch 2.13.0, transformers 4.36.2, eagle-llm 1.2.1 from PyPI without its
dependencies, never a dependency of the project) runs conformance/official_eagle.py, which prints each fix it
applies to the official code and answers request files with result files (JSON). The tree is the package's
own static tree (eagle.model.choices.mc_sim_7b_63, 25 nodes), which the runner reports and we decode on too.
The draft layer is one file in the authors' format (models/methods/eagle/eagle_format.py write_eagle_module): the
official EaModel loads it, ours reads the same file back (read_eagle) and drafts over the full vocabulary with
the base LM head, as the official drafter does. Two cases:
  golden   a layer from a seed (models/measure/conformance.py seeded_eagle_module), a few MT-Bench first turns:
           the official steps go to tests/golden/eagle_conformance.json, which tests/test_conformance_eagle.py
           replays against our decoder without the old environment;
  trained  results/heads/eagle (when trained), its draft vocabulary dropped (the format has none).
The runs alternate between the two decoders question by question (the order swapped each time);
reports/conformance_eagle.json holds the steps compared, the first mismatch if any, the runner's checks of its
fixes, and tokens/s per decoder (medians over the runs).
"""
from __future__ import annotations

from pipelines import omp  # noqa: F401,I001  (first: OpenMP's wait policy is read when torch loads)
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

from models.base import load_base_model
from models.engine.drafters import make_drafter
from models.engine.fast_inference import prepare_for_decoding
from models.methods.eagle.eagle_format import read_eagle, write_eagle_module
from models.hardware import cpu_model
from models.measure.conformance import accepted_counts, compare_steps, paths_tree, record_steps, seeded_eagle_module
import models.methods.drafting  # noqa: F401  (every method, and its proposer)
from models.shared.drafting import load_for_decoding
from pipelines.common import REPO_ROOT, write_json
from pipelines import conformance
from pipelines.conformance import Official, _agrees, _paired, _tokens, baseline, official_env, prompts

VENV = REPO_ROOT / ".venv-conformance-eagle"
OFFICIAL_PACKAGES = (["torch==2.13.0", "transformers==4.36.2"], ["--no-deps", "eagle-llm==1.2.1"])
RUNNER = REPO_ROOT / "conformance" / "official_eagle.py"
GOLDEN = REPO_ROOT / "tests" / "golden" / "eagle_conformance.json"
REPORT = REPO_ROOT / "reports" / "conformance_eagle.json"
TREE = "eagle_mc_sim_7b_63"


def run_case(name: str, model, tok, module, prompt_list: list[dict], new_tokens: int, repeats: int, args) -> dict:
    """Both decoders on every prompt, interleaved; -> the case's records, timings, tree and the runner's checks."""
    work = Path(tempfile.mkdtemp(prefix=f"conformance-eagle-{name}-"))
    write_eagle_module(module, model, work / "eagle-official")
    ours = read_eagle(work / "eagle-official", model).eagle          # the very file the official code loads
    official = Official(official_env(VENV, OFFICIAL_PACKAGES), RUNNER, "EAGLE", work, args.threads,
                        prompt_list[0]["ids"], model=Path(args.model).resolve(), eagle=work / "eagle-official")
    tree = [list(p) for p in official.ready["tree"]]
    drafter = make_drafter({"kind": "eagle", "tree": paths_tree(TREE, tree)}, eagle=ours)
    official.decode(prompt_list[0]["ids"], 8)                         # warm-up, untimed
    record_steps(model, drafter, prompt_list[0]["ids"], 8, tok.eos_token_id)
    runs, steps = {"ours": [], "official": []}, []
    for r in range(repeats):
        for qi, p in enumerate(prompt_list):
            order = ("official", "ours") if (r * len(prompt_list) + qi) % 2 == 0 else ("ours", "official")
            got = {}
            for who in order:
                got[who] = (official.decode(p["ids"], new_tokens) if who == "official" else
                            record_steps(model, drafter, p["ids"], new_tokens, tok.eos_token_id))
                runs[who].append(len(got[who]["new_tokens"]) / got[who]["seconds"])
            if r == 0:
                steps.append({"question_id": p["question_id"], "ours": got["ours"]["steps"],
                              "official": got["official"]["steps"]})
            print(f"{name} q{p['question_id']} run {r}: "
                  + ", ".join(f"{w} {runs[w][-1]:.2f} tok/s" for w in order), flush=True)
    official.close()
    return {"runs": runs, "steps": steps, "tree": tree, "checks": official.ready["checks"]}


def summarize(case: dict, base: dict | None, new_tokens: int) -> dict:
    per_q = case["steps"]
    results = [compare_steps(q["ours"], q["official"]) for q in per_q]
    first = next(({"question_id": q["question_id"], **r["first_mismatch"]} for q, r in zip(per_q, results)
                  if not r["identical"]), None)
    counts = [c for q in per_q for c in accepted_counts(q["official"])]
    row = {"steps_compared": sum(r["compared"] for r in results),
           "identical": all(r["identical"] for r in results), "first_mismatch": first,
           "steps_identical": sum(r["compared"] - (not r["identical"]) for r in results),
           "steps_accepting_drafts": sum(c > 0 for c in counts), "accepted_drafts": sum(counts),
           "mean_tokens_per_step": (sum(counts) + len(counts)) / max(1, len(counts)),
           "tokens_per_second": {w: statistics.median(v) for w, v in case["runs"].items()},
           "runs": {w: len(v) for w, v in case["runs"].items()},
           "ours_over_official_paired": _paired(case["runs"]), "tokens_per_second_runs": case["runs"],
           "official_checks": case["checks"]}
    if base is not None:
        row["matches_baseline"] = {w: all(_agrees(_tokens(q[w])[:new_tokens], b)
                                          for q, b in zip(per_q, base["tokens"])) for w in ("ours", "official")}
        row["baseline_tokens_per_second"] = statistics.median(base["tokens_per_second"])
    return row


def write_golden(case: dict, prompt_list: list[dict], settings: dict, path: Path = GOLDEN) -> None:
    """The official decoder's steps for the seeded layer: what tests/test_conformance_eagle.py replays."""
    golden = {"about": "per-step tokens (root, then accepted drafts) of the authors' EAGLE-1 code (eagle-llm 1.2.1 "
                       "EaModel.eagenerate, greedy, its static tree) on a draft layer from a seed; written by "
                       "`make conformance-eagle`",
              **settings, "tree": {"name": TREE, "paths": case["tree"]},
              "prompts": [{k: p[k] for k in ("question_id", "category", "ids")} for p in prompt_list],
              "steps": [q["official"] for q in case["steps"]],
              "output_tokens": [_tokens(q["official"]) for q in case["steps"]]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(golden, separators=(",", ":")) + "\n")
    print(f"wrote {path.relative_to(REPO_ROOT)}", flush=True)


def one_case(name: str, model, tok, module, prompt_list, new_tokens: int, repeats: int, args) -> tuple[dict, dict]:
    base = baseline(model, tok, prompt_list, new_tokens) if args.baseline else None
    case = run_case(name, model, tok, module, prompt_list, new_tokens, repeats, args)
    row = summarize(case, base, new_tokens)
    verdict = ("identical accepted drafts on every compared step" if row["identical"] else
               f"FIRST MISMATCH: {row['first_mismatch']}")
    print(f"{name}: {row['steps_compared']} steps compared: {verdict}; {row['steps_accepting_drafts']} steps "
          f"accepted drafts, {row['mean_tokens_per_step']:.2f} tokens a step; tokens/s ours "
          f"{row['tokens_per_second']['ours']:.2f}, official {row['tokens_per_second']['official']:.2f}"
          + (f"; both match the baseline: {row['matches_baseline']}" if base else ""), flush=True)
    return case, {"questions": len(prompt_list), "new_tokens": new_tokens, "repeats": repeats, **row}


def parse_args(argv=None):
    return conformance.parse_args(argv, __doc__.split("\n")[2], "results/heads/eagle", questions=3, new_tokens=32)


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.chdir(REPO_ROOT)                 # the heads name their base model by its path from here
    torch.set_num_threads(args.threads)
    model, tok = load_base_model(args.model)
    prepare_for_decoding(model)
    earlier = json.loads(REPORT.read_text()).get("cases", {}) if REPORT.is_file() else {}
    report = {"machine": cpu_model(), "threads": args.threads,
              "official": "eagle-llm 1.2.1 (eagle.model.EaModel.eagenerate), transformers 4.36.2",
              "cases": {k: v for k, v in earlier.items() if k in args.skip}}
    if "golden" not in args.skip:
        plist = prompts(Path(args.questions_file), args.golden_questions, tok)
        module = seeded_eagle_module(model, args.seed, args.scale)
        case, report["cases"]["golden"] = one_case("golden", model, tok, module, plist, args.golden_tokens, 1, args)
        report["cases"]["golden"]["eagle"] = {"seed": args.seed, "scale": args.scale}
        write_golden(case, plist, {"seed": args.seed, "scale": args.scale, "max_new_tokens": args.golden_tokens,
                                   "threads": args.threads})
    if "trained" not in args.skip and Path(args.heads).is_dir():
        model_t, heads, _ = load_for_decoding(args.heads, model, bf16_heads=False)   # float32: the authors' products
        plist = prompts(Path(args.questions_file), args.questions, tok)
        _, report["cases"]["trained"] = one_case("trained", model_t, tok, heads.draft_module, plist,
                                                 args.new_tokens, args.repeats, args)
        report["cases"]["trained"]["eagle"] = args.heads
    elif "trained" not in args.skip:
        print(f"no trained heads in {args.heads}: the trained case is left out", flush=True)
    write_json(REPORT, report)
    print(f"wrote {REPORT.relative_to(REPO_ROOT)}", flush=True)
    return report


if __name__ == "__main__":
    main()
