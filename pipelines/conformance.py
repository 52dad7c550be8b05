"""python -m pipelines.conformance        (make conformance)    [--questions 8 --new-tokens 64 --repeats 1 ...]

Our decoder judged by the authors' Medusa code (docs/conformance.md), step by step, on the same heads, prompts
and trees. The official code runs in its own environment and process: .venv-conformance (built here on first
use: torch 2.13.0, transformers 4.34.1, medusa-llm 0.1 from PyPI, never a dependency of the project) runs
conformance/official_medusa.py, which prints each fix it applies to the official code and answers request files
with result files (JSON). Two trees: 0.1's medusa_choices=[1, 7, 6] and HEAD's 63-node mc_sim_7b_63 (= our
conf/tree/sparse64.yaml, checked). Two cases:
  golden   heads from a seed (models/measure/conformance.py seeded_medusa_heads), a few MT-Bench first turns:
           the official steps go to tests/golden/medusa_conformance.json, which tests/test_conformance.py replays
           against our decoder without the old environment;
  trained  results/heads/medusa1 (when trained) exported to the official format: the main comparison.
The runs alternate between the two decoders question by question (the order swapped each time), so machine
drift hits both; reports/conformance.json and reports/conformance.md hold the steps compared, the first
mismatch if any, and tokens/s per decoder and tree (medians over the runs), beside our autoregressive baseline.
"""
from __future__ import annotations

from pipelines import omp  # noqa: F401,I001  (first: OpenMP's wait policy is read when torch loads)
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from analysis.conformance import TREE_NAMES, conformance_markdown
from models.base import load_base_model
from models.engine.decoding import generate
from models.engine.drafters import make_drafter
from models.engine.fast_inference import prepare_for_decoding, prepare_heads_for_decoding
from models.engine.trees import tree_from_config
from models.shared.formats import export_heads
from models.methods.medusa.formats import import_medusa
from models.measure.conformance import (accepted_counts, compare_steps, medusa_v01_tree, record_steps,
                                        seeded_medusa_heads)
from models.hardware import cpu_model
from models.measure.mtbench import chat_input_ids, load_questions
import models.methods.drafting  # noqa: F401  (every method, and its proposer)
from models.shared.drafting import load_for_decoding
from pipelines.common import REPO_ROOT, write_json

VENV = REPO_ROOT / ".venv-conformance"
OFFICIAL_PACKAGES = (["torch==2.13.0", "transformers==4.34.1"], ["--no-deps", "medusa-llm==0.1"])
RUNNER = REPO_ROOT / "conformance" / "official_medusa.py"
GOLDEN = REPO_ROOT / "tests" / "golden" / "medusa_conformance.json"
REPORTS = REPO_ROOT / "reports"
TREES = ("v0.1", "head63")          # the runner's names: 0.1's [1, 7, 6] and HEAD's mc_sim_7b_63


def official_env(venv: Path = VENV, installs: tuple[list[str], ...] = OFFICIAL_PACKAGES) -> Path:
    """The conformance environment's python, built on first use (pip from the package index, one install per
    list of `installs`)."""
    py = venv / "bin" / "python"
    stamp = venv / ".installed"
    if not stamp.is_file():
        print(f"building {venv}: {' '.join(a for step in installs for a in step)}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        for packages in installs:
            subprocess.run([str(py), "-m", "pip", "install", "-q", *packages], check=True)
        stamp.write_text("\n".join(a for step in installs for a in step) + "\n")
    return py


class Official:
    """An official runner (conformance/official_<name>.py) in its environment: one request file in, one result file
    out. `paths`: its path options (--model, --heads, --eagle); `ready`: what it reported on start."""

    def __init__(self, py: Path, runner: Path, name: str, work: Path, threads: int, check_ids: list[int], **paths):
        self.work, self.name = work, name
        flags = [a for key, path in paths.items() for a in (f"--{key}", str(path))]
        self.proc = subprocess.Popen(
            [str(py), str(runner), *flags, "--work", str(work), "--threads", str(threads),
             "--check-ids", ",".join(map(str, check_ids))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = json.loads(self.proc.stdout.readline() or "{}")
        if not self.ready.get("ready"):
            raise RuntimeError(f"the official {name} runner did not start (see its messages above)")
        self.count = 0

    def decode(self, ids: list[int], max_new_tokens: int, **extra) -> dict:
        """One answer; `extra` goes into the request as it is (Medusa's runner: the tree)."""
        self.count += 1
        request = self.work / f"request-{self.count}.json"
        request.write_text(json.dumps({**extra, "ids": ids, "max_new_tokens": max_new_tokens}))
        self.proc.stdin.write(f"{request}\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        if not answer:
            raise RuntimeError(f"the official {self.name} runner stopped on {request}")
        return json.loads(Path(answer).read_text())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def mc_sim_7b_63(official: Official) -> list[tuple]:
    """HEAD's 63-node tree as the Medusa runner reported it."""
    return [tuple(p) for p in official.ready["mc_sim_7b_63"]]


def our_trees(official: Official) -> dict:
    """Our TreeSpecs for the runner's trees; HEAD's list must be conf/tree/sparse64.yaml's."""
    sparse64 = tree_from_config(yaml.safe_load((REPO_ROOT / "conf" / "tree" / "sparse64.yaml").read_text()))
    if sorted(sparse64.paths) != sorted(mc_sim_7b_63(official)):
        raise ValueError("conf/tree/sparse64.yaml is not HEAD's mc_sim_7b_63")
    return {"v0.1": medusa_v01_tree(), "head63": sparse64}


def prompts(questions_file: Path, n: int, tok) -> list[dict]:
    return [{"question_id": q.question_id, "category": q.category, "ids": chat_input_ids(tok, [q.turns[0]], [])}
            for q in load_questions(questions_file, n)]


def run_case(name: str, model, tok, heads, prompt_list: list[dict], new_tokens: int, repeats: int, args) -> dict:
    """Both decoders on every prompt and tree, interleaved; -> the case's records and timings."""
    work = Path(tempfile.mkdtemp(prefix=f"conformance-{name}-"))
    export_heads(heads, model, work / "heads-official", "medusa")
    ours_heads = import_medusa(work / "heads-official", model)       # the very file the official code loads
    prepare_heads_for_decoding(ours_heads, bf16=False)                # float32, as the official heads
    official = Official(official_env(), RUNNER, "Medusa", work, args.threads, prompt_list[0]["ids"],
                        model=Path(args.model).resolve(), heads=work / "heads-official")
    trees = our_trees(official)
    drafters = {t: make_drafter({"kind": "heads", "tree": spec}, heads=ours_heads) for t, spec in trees.items()}
    for tree in TREES:                  # warm-up, untimed: first-call allocations (0.1's KV cache, our packing)
        official.decode(prompt_list[0]["ids"], 8, tree=tree)
        record_steps(model, drafters[tree], prompt_list[0]["ids"], 8, tok.eos_token_id)
    runs = {t: {"ours": [], "official": []} for t in TREES}
    steps = {t: [] for t in TREES}
    for r in range(repeats):
        for qi, p in enumerate(prompt_list):
            order = ("official", "ours") if (r * len(prompt_list) + qi) % 2 == 0 else ("ours", "official")
            for tree in TREES:
                got = {}
                for who in order:
                    got[who] = (official.decode(p["ids"], new_tokens, tree=tree) if who == "official" else
                                record_steps(model, drafters[tree], p["ids"], new_tokens, tok.eos_token_id))
                    runs[tree][who].append(len(got[who]["new_tokens"]) / got[who]["seconds"])
                if r == 0:
                    steps[tree].append({"question_id": p["question_id"], "ours": got["ours"]["steps"],
                                        "official": got["official"]["steps"]})
                print(f"{name} {tree} q{p['question_id']} run {r}: " + ", ".join(
                    f"{w} {runs[tree][w][-1]:.2f} tok/s" for w in order), flush=True)
    official.close()
    return {"runs": runs, "steps": steps, "mc_sim_7b_63": mc_sim_7b_63(official)}


def baseline(model, tok, prompt_list: list[dict], new_tokens: int) -> dict:
    out = {"tokens": [], "tokens_per_second": []}
    for p in prompt_list:
        res = generate(model, tok, p["ids"], max_new_tokens=new_tokens, stop_token_ids=[tok.eos_token_id])
        out["tokens"].append(res.new_tokens)
        out["tokens_per_second"].append(res.tokens_per_second)
    return out


def summarize(case: dict, base: dict | None, new_tokens: int) -> dict:
    out = {}
    for tree in TREES:
        per_q = case["steps"][tree]
        results = [compare_steps(q["ours"], q["official"]) for q in per_q]
        first = next(({"question_id": q["question_id"], **r["first_mismatch"]} for q, r in zip(per_q, results)
                      if not r["identical"]), None)
        counts = [c for q in per_q for c in accepted_counts(q["official"])]
        row = {"steps_compared": sum(r["compared"] for r in results),
               "identical": all(r["identical"] for r in results), "first_mismatch": first,
               "steps_accepting_drafts": sum(c > 0 for c in counts), "accepted_drafts": sum(counts),
               "mean_tokens_per_step": (sum(counts) + len(counts)) / max(1, len(counts)),
               "tokens_per_second": {w: statistics.median(v) for w, v in case["runs"][tree].items()},
               "runs": {w: len(v) for w, v in case["runs"][tree].items()},
               "ours_over_official_paired": _paired(case["runs"][tree]), "tokens_per_second_runs": case["runs"][tree]}
        if base is not None:
            row["matches_baseline"] = {w: all(_agrees(_tokens(q[w])[:new_tokens], b)
                                              for q, b in zip(per_q, base["tokens"])) for w in ("ours", "official")}
        out[tree] = row
    return out


def _tokens(steps: list[list[int]]) -> list[int]:
    return [t for s in steps for t in s]


def _paired(runs: dict) -> dict:
    """Median and range of ours / official over the runs, each pair taken back to back on one question."""
    ratios = [o / f for o, f in zip(runs["ours"], runs["official"])]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def _agrees(a: list[int], b: list[int]) -> bool:
    """The same tokens as far as both go (the baseline stops at EOS, a tree step may append drafts past it)."""
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def write_golden(case: dict, prompt_list: list[dict], settings: dict, path: Path = GOLDEN) -> None:
    """The official decoder's steps for the seeded heads: what tests/test_conformance.py replays."""
    golden = {"about": "per-step tokens (root, then accepted drafts) of the authors' Medusa code (medusa-llm 0.1 "
                       "+ HEAD e2a5d20 tree code) on heads from a seed; written by `make conformance`",
              **settings, "prompts": [{k: p[k] for k in ("question_id", "category", "ids")} for p in prompt_list],
              "trees": {"v0.1": {"medusa_choices": [1, 7, 6]}, "head63": {"conf_tree": "sparse64"}},
              "steps": {t: [q["official"] for q in case["steps"][t]] for t in TREES}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(golden, separators=(",", ":")) + "\n")
    print(f"wrote {path.relative_to(REPO_ROOT)}", flush=True)


def one_case(name: str, model, tok, heads, prompt_list, new_tokens: int, repeats: int, args) -> tuple[dict, dict]:
    base = baseline(model, tok, prompt_list, new_tokens) if args.baseline else None
    case = run_case(name, model, tok, heads, prompt_list, new_tokens, repeats, args)
    trees = summarize(case, base, new_tokens)
    for tree, row in trees.items():
        verdict = ("identical accepted drafts on every compared step" if row["identical"] else
                   f"FIRST MISMATCH: {row['first_mismatch']}")
        print(f"{name} / {TREE_NAMES[tree]}: {row['steps_compared']} steps compared: {verdict}; "
              f"{row['steps_accepting_drafts']} steps accepted drafts; tokens/s ours "
              f"{row['tokens_per_second']['ours']:.2f}, official {row['tokens_per_second']['official']:.2f}"
              + (f"; both match the baseline: {row['matches_baseline']}" if base else ""), flush=True)
    summary = {"questions": len(prompt_list), "new_tokens": new_tokens, "repeats": repeats, "trees": trees}
    if base:
        summary["baseline_tokens_per_second"] = statistics.median(base["tokens_per_second"])
    return case, summary


def earlier_cases(skipped: list[str]) -> dict:
    """The cases left out this time (--skip), as the last report has them."""
    path = REPORTS / "conformance.json"
    cases = json.loads(path.read_text()).get("cases", {}) if path.is_file() else {}
    return {name: case for name, case in cases.items() if name in skipped}


def parse_args(argv=None, description: str = __doc__.split("\n")[2], heads: str = "results/heads/medusa1",
               questions: int = 8, new_tokens: int = 64):
    """The options of both conformance runs (this one and pipelines.conformance_eagle), with the run's defaults."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="artifacts/models/SmolLM2-135M-Instruct", help="relative to the repository")
    ap.add_argument("--questions-file", default="artifacts/raw/mt_bench_question.jsonl")
    ap.add_argument("--heads", default=heads)
    ap.add_argument("--questions", type=int, default=questions)
    ap.add_argument("--new-tokens", type=int, default=new_tokens)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--golden-questions", type=int, default=3)
    ap.add_argument("--golden-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=0.02)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-baseline", dest="baseline", action="store_false")
    ap.add_argument("--skip", choices=("golden", "trained"), action="append", default=[])
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.chdir(REPO_ROOT)                 # the heads name their base model by its path from here
    torch.set_num_threads(args.threads)
    if not Path(args.model).is_dir():
        from pipelines.assets import build_assets
        art = REPO_ROOT / "artifacts"
        build_assets(art, art / "raw" / "ShareGPT_V3_unfiltered_cleaned_split.json", Path(args.questions_file),
                     reuse=True)
    model, tok = load_base_model(args.model)
    prepare_for_decoding(model)
    report = {"machine": cpu_model(),
              "threads": args.threads, "official": "medusa-llm 0.1 + FasterDecoding/Medusa e2a5d20 tree code, "
              "transformers 4.34.1", "cases": earlier_cases(args.skip)}
    if "golden" not in args.skip:
        plist = prompts(Path(args.questions_file), args.golden_questions, tok)
        heads = seeded_medusa_heads(model, args.seed, 4, args.scale)
        case, report["cases"]["golden"] = one_case("golden", model, tok, heads, plist, args.golden_tokens, 1, args)
        report["cases"]["golden"]["heads"] = {"seed": args.seed, "scale": args.scale, "num_heads": 4}
        write_golden(case, plist, {"seed": args.seed, "scale": args.scale, "num_heads": 4,
                                   "max_new_tokens": args.golden_tokens})
    if "trained" not in args.skip and Path(args.heads).is_dir():
        model_t, heads, _ = load_for_decoding(args.heads, model, bf16_heads=False)   # float32: the authors' products
        plist = prompts(Path(args.questions_file), args.questions, tok)
        _, report["cases"]["trained"] = one_case("trained", model_t, tok, heads, plist, args.new_tokens, args.repeats,
                                                 args)
        report["cases"]["trained"]["heads"] = args.heads
    elif "trained" not in args.skip:
        print(f"no trained heads in {args.heads}: the trained case is left out", flush=True)
    write_json(REPORTS / "conformance.json", report)
    (REPORTS / "conformance.md").write_text(conformance_markdown(report))
    print(conformance_markdown(report), flush=True)
    return report


if __name__ == "__main__":
    main()
