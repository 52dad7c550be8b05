"""The harness both conformance drivers share (pipelines/conformance.py: Medusa, pipelines/conformance_eagle.py:
EAGLE-1; docs/conformance.md): the official runner in its own environment and process, the prompts, our
autoregressive baseline, the two decoders run in turns, the report row made from the steps compared, the golden
file and one case run from end to end. What is a method's own (its runner, packages, trees, run_case, golden
settings) stays in its driver.

    official = Official(official_env(VENV, PACKAGES), RUNNER, "Medusa", work, threads, ids, model=..., heads=...)
    for r, p, order in interleaved(prompt_list, repeats):
        got = decode_both(order, {"official": ..., "ours": ...}, runs)      # each a call -> {"steps", ...}
    row = steps_row(per_question, runs, base, new_tokens)                     # one tree's report row
    case, summary = one_case("golden", run_case, summarize, model, tok, heads, prompt_list, 32, 1, args)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from models.base import load_base_model
from models.engine.decoding import generate
from models.engine.path_choice import prepare_for_decoding
from models.measure.conformance import accepted_counts, compare_steps
from models.measure.mtbench import chat_input_ids, load_questions
from models.methods import load_for_decoding
from pipelines.common import REPO_ROOT

PROMPT_FIELDS = ("question_id", "category", "ids")      # what a golden file keeps of a prompt


# the speculators library's own environment (make interop, make dflash-check): never a dependency of the project
SPECULATORS_VENV = REPO_ROOT / ".venv-speculators"
SPECULATORS_PACKAGES = (["torch==2.13.0"],
                        ["transformers==5.19.0", "hs-connectors", "datasets<=5.1.0", "pydantic-settings", "loguru",
                         "openai", "psutil", "protobuf", "httpx", "aiohttp"],
                        ["--no-deps", "speculators==0.9.0"])


def official_env(venv: Path, installs: tuple[list[str], ...]) -> Path:
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


def prompts(questions_file: Path, n: int, tok) -> list[dict]:
    """The first turns of the first `n` MT-Bench questions, as chat input ids."""
    return [{"question_id": q.question_id, "category": q.category, "ids": chat_input_ids(tok, [q.turns[0]], [])}
            for q in load_questions(questions_file, n)]


def baseline(model, tok, prompt_list: list[dict], new_tokens: int) -> dict:
    """Our decoder without drafts on every prompt -> {"tokens", "tokens_per_second"}, one entry a prompt."""
    out = {"tokens": [], "tokens_per_second": []}
    for p in prompt_list:
        res = generate(model, tok, p["ids"], max_new_tokens=new_tokens, stop_token_ids=[tok.eos_token_id])
        out["tokens"].append(res.new_tokens)
        out["tokens_per_second"].append(res.tokens_per_second)
    return out


def interleaved(prompt_list: list[dict], repeats: int) -> Iterator[tuple[int, dict, tuple[str, str]]]:
    """(repeat, prompt, the decoders' order) for every run; the order swaps each time, so machine drift hits
    both decoders alike."""
    for r in range(repeats):
        for qi, p in enumerate(prompt_list):
            yield r, p, ("official", "ours") if (r * len(prompt_list) + qi) % 2 == 0 else ("ours", "official")


def decode_both(order: tuple[str, str], decoders: dict[str, Callable[[], dict]], runs: dict) -> dict:
    """Each decoder's answer, in `order`; its tokens/s goes on runs[who]."""
    got = {}
    for who in order:
        got[who] = decoders[who]()
        runs[who].append(len(got[who]["new_tokens"]) / got[who]["seconds"])
    return got


def timing_line(label: str, order: tuple[str, str], runs: dict) -> str:
    """The last run's tokens/s per decoder, for the log."""
    return f"{label}: " + ", ".join(f"{w} {runs[w][-1]:.2f} tok/s" for w in order)


def output_tokens(steps: list[list[int]]) -> list[int]:
    """The tokens a decoder appended, its steps run together."""
    return [t for s in steps for t in s]


def paired_ratio(runs: dict) -> dict:
    """Median and range of ours / official over the runs, each pair taken back to back on one question."""
    ratios = [o / f for o, f in zip(runs["ours"], runs["official"])]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def agrees(a: list[int], b: list[int]) -> bool:
    """The same tokens as far as both go (the baseline stops at EOS, a tree step may append drafts past it)."""
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def steps_row(per_q: list[dict], runs: dict, base: dict | None, new_tokens: int, count_identical: bool = False,
              **extra) -> dict:
    """One tree's report row from its compared steps (per question {"question_id", "ours", "official"}) and its
    timings: the first mismatch, the drafts the official decoder accepted, tokens/s per decoder (medians) and
    whether both match our baseline. count_identical: add how many steps matched (EAGLE's row); `extra` goes in
    before the baseline's match."""
    results = [compare_steps(q["ours"], q["official"]) for q in per_q]
    first = next(({"question_id": q["question_id"], **r["first_mismatch"]} for q, r in zip(per_q, results)
                  if not r["identical"]), None)
    counts = [c for q in per_q for c in accepted_counts(q["official"])]
    row = {"steps_compared": sum(r["compared"] for r in results),
           "identical": all(r["identical"] for r in results), "first_mismatch": first}
    if count_identical:
        row["steps_identical"] = sum(r["compared"] - (not r["identical"]) for r in results)
    row |= {"steps_accepting_drafts": sum(c > 0 for c in counts), "accepted_drafts": sum(counts),
            "mean_tokens_per_step": (sum(counts) + len(counts)) / max(1, len(counts)),
            "tokens_per_second": {w: statistics.median(v) for w, v in runs.items()},
            "runs": {w: len(v) for w, v in runs.items()},
            "ours_over_official_paired": paired_ratio(runs), "tokens_per_second_runs": runs, **extra}
    if base is not None:
        row["matches_baseline"] = {w: all(agrees(output_tokens(q[w])[:new_tokens], b)
                                          for q, b in zip(per_q, base["tokens"])) for w in ("ours", "official")}
    return row


def verdict_line(label: str, row: dict, base: dict | None) -> str:
    """A row in one line, for the log."""
    verdict = ("identical accepted drafts on every compared step" if row["identical"] else
               f"FIRST MISMATCH: {row['first_mismatch']}")
    return (f"{label}: {row['steps_compared']} steps compared: {verdict}; {row['steps_accepting_drafts']} steps "
            f"accepted drafts, {row['mean_tokens_per_step']:.2f} tokens a step; tokens/s ours "
            f"{row['tokens_per_second']['ours']:.2f}, official {row['tokens_per_second']['official']:.2f}"
            + (f"; both match the baseline: {row['matches_baseline']}" if base else ""))


def one_case(name: str, run_case: Callable, summarize: Callable, model, tok, heads, prompt_list: list[dict],
             new_tokens: int, repeats: int, args, trees: dict[str, str] | None = None) -> tuple[dict, dict]:
    """One case: our baseline (unless --no-baseline), the driver's `run_case`, its `summarize` (case, base,
    new_tokens) -> a row per tree under "trees" when `trees` names them (Medusa), else one row spread into the
    summary (EAGLE); -> the case's records and its summary for the report."""
    base = baseline(model, tok, prompt_list, new_tokens) if args.baseline else None
    case = run_case(name, model, tok, heads, prompt_list, new_tokens, repeats, args)
    rows = summarize(case, base, new_tokens)
    labelled = {f"{name} / {trees[t]}": row for t, row in rows.items()} if trees else {name: rows}
    for label, row in labelled.items():
        print(verdict_line(label, row, base), flush=True)
    summary = {"questions": len(prompt_list), "new_tokens": new_tokens, "repeats": repeats,
               **({"trees": rows} if trees else rows)}
    if base:
        summary["baseline_tokens_per_second"] = statistics.median(base["tokens_per_second"])
    return case, summary


def write_golden(path: Path, about: str, settings: dict, prompt_list: list[dict], fields: dict) -> None:
    """A golden file (tests/golden/*_conformance.json): `about`, the run's `settings`, the prompts, then `fields`
    (the official steps and what a test needs beside them)."""
    golden = {"about": about, **settings, "prompts": [{k: p[k] for k in PROMPT_FIELDS} for p in prompt_list],
              **fields}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(golden, separators=(",", ":")) + "\n")
    print(f"wrote {path.relative_to(REPO_ROOT)}", flush=True)


def earlier_cases(report: Path, skipped: list[str]) -> dict:
    """The cases left out this time (--skip), as the last report has them."""
    cases = json.loads(report.read_text()).get("cases", {}) if report.is_file() else {}
    return {name: case for name, case in cases.items() if name in skipped}


def load_base(args):
    """The base model packed for decoding, run from the repository root on --threads threads -> (model, tok)."""
    os.chdir(REPO_ROOT)                 # the heads name their base model by its path from here
    torch.set_num_threads(args.threads)
    model, tok = load_base_model(args.model)
    prepare_for_decoding(model)
    return model, tok


def trained_heads(args, model):
    """--heads on `model` for the trained case, float32 as the authors' products -> (model, heads); None, said,
    when the case is skipped or nothing was trained there."""
    if "trained" in args.skip:
        return None
    if not Path(args.heads).is_dir():
        print(f"no trained heads in {args.heads}: the trained case is left out", flush=True)
        return None
    model_t, heads, _ = load_for_decoding(args.heads, model, bf16_heads=False)
    return model_t, heads


def parse_args(argv, description: str, heads: str, questions: int, new_tokens: int):
    """The options of both conformance runs, with the run's defaults."""
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
