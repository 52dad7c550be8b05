"""python -m pipelines.evaluate [heads=hydra_pp tree=sparse64] [profile=smoke] [eval.methods=all|selected|auto]

MT-Bench speed evaluation at batch size 1, every method in this one process:
  baseline                 autoregressive decoding with the base model (heads=None)
  <heads>-<tree>           each trained heads folder results/heads/<heads> on each tree; a tree with
                           `lookup: true` (optimal_pld, dynamic_pld) merges prompt lookup's chain into it
  pld                      prompt lookup decoding in our decoder (models/engine/prompt_lookup.py): the same
                           loop and decode step as the heads (eval.prompt_lookup.pld)
  pld_hf                   prompt lookup decoding in transformers' generate, the reference
                           (eval.prompt_lookup.pld_hf); a method beats prompt lookup if it beats both
  baseline-<heads>         autoregressive reference of a backbone changed by a LoRA adapter (Medusa-2):
                           only used to check that family's losslessness, not a table entry
Which heads and trees: eval.methods (conf/eval/mtbench.yaml). `all` (the default run) = every family in
profile.eval.families x every tree in profile.eval.trees, written to results/eval/all/ and
reports/metrics/evaluate.json; overriding heads= or tree= selects that one method (plus baseline and
the two PLDs), written to results/eval/<heads>-<tree>/ and reports/metrics/evaluate_<heads>-<tree>.json.
In DVC: stage `evaluate` runs eval.methods=all; `dvc exp run -S heads=hydra_pp -S tree=sparse64` adds
the stage evaluate_selected@hydra_pp-sparse64 (eval.selected_runs) and leaves `evaluate` as it was.

Protocol (REFERENCE.md section 4): profile.eval.turns turns per question (turn 2 sees turn 1's answer:
the baseline's, so every method gets the same prompt), warm-up generations first, greedy unless
eval.temperature_mode=category; for each question the methods run back to back, their order rotated
from question to question, so machine drift cancels in the ratios; profile.eval.repeats runs. Every
turn records its prefill and decode time: speedups end to end and decode-only (models/measure/benchmark.py).
In the full run (eval.methods=all) a tree in profile.eval.tree_questions runs on that many of the
questions only (spread over the categories; its speedups are over those questions, the tables say so).
Outputs in results/eval/<tag>/: <method>.json (settings, summary, every turn record), summary.json
(what pipelines.tables reads), lossless_report.json. The stage fails after writing them all when a
greedy turn of any method differs from its reference, naming question, turn, method and position.
Resumable: each question of each run, all its methods, is written whole (temporary file + rename) as it
finishes, to data/eval-records/<model.name>/<tag>/ (outside the DVC output, which DVC deletes before a
rerun). A run killed and started again reads those back (a half-done question is redone) and writes the
same outputs: they are computed from the stored records only. The records' fingerprint covers the stage's
params, questions, resolved trees, heads and model files, code, library versions, hardware and threads;
when it changes the folder is discarded. A cut-off or foreign record file is redone, a .tmp never read.
"""
from __future__ import annotations

from pipelines import omp  # noqa: F401,I001  (first: OpenMP's wait policy is read when torch loads)
import copy
import dataclasses
import hashlib
import json
import os
import platform
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from omegaconf import DictConfig, ListConfig, OmegaConf
from tqdm import tqdm

from models.measure.latency import relative_step_costs
from models.measure.benchmark import (TurnRecord, category_temperature, chat_input_ids, first_difference, greedy_margin,
                              load_questions, prompt_lookup_generate, rotated, speedup_on_questions_of, spread,
                              summarize_method, token_agreement)
from models.engine.decoding import SamplingConfig, generate
from models.engine.fast_inference import prepare_for_decoding, prepare_heads_for_decoding
from models.heads import ADAPTER_DIR, load_heads
from models.engine.prompt_lookup import PromptLookupDrafter
from models.engine.trees import TreeSpec, tree_from_config
from pipelines.common import REPO_ROOT, atomic_file, file_sha256, load_model, log, mlflow_run, stage, write_json
from pipelines.deps import code_digest

METHOD_MODES = ("auto", "all", "selected")


class LosslessnessError(RuntimeError):
    """A greedy method produced tokens that differ from its autoregressive reference."""


@dataclass
class Method:
    name: str
    kind: str                      # baseline | heads | pld | pld_hf | reference
    model: object
    heads: object = None
    tree: TreeSpec | None = None
    heads_name: str | None = None
    family: str | None = None
    reference: str | None = None   # the method whose greedy tokens this one must reproduce
    tree_name: str | None = None   # the conf/tree option (profile.eval.tree_questions is keyed by it)
    step_cost: list[float] | None = None   # tree cut per step by cost (conf/tree/dynamic.yaml cut_by_cost)
    lookup: bool = False           # prompt lookup's chain merged into the tree (conf/tree/optimal_pld.yaml)

    def describe(self) -> dict:
        return {"kind": self.kind, "heads": self.heads_name, "family": self.family,
                "tree": self.tree.name if self.tree else None, "tree_nodes": self.tree.num_nodes if self.tree else None,
                "reference": self.reference, "cut_by_cost": self.step_cost is not None, "lookup_branch": self.lookup}


# -- 1) which methods ----------------------------------------------------------------------------
@dataclass
class Selection:
    mode: str                      # all | selected
    tag: str                       # results/eval/<tag>/
    metrics_name: str              # reports/metrics/<metrics_name>.json
    heads: list[str]               # heads names (results/heads/<name>)
    trees: list[str | None]        # tree names; None = this config's own tree


def selection(cfg: DictConfig) -> Selection:
    """What to run: eval.methods = all | selected, or auto (conf/eval/mtbench.yaml's eval.tag rule)."""
    methods = cfg.eval.methods
    if methods not in METHOD_MODES:
        raise ValueError(f"eval.methods={methods!r} is not known; use one of {list(METHOD_MODES)}")
    mode = methods if methods != "auto" else ("all" if cfg.eval.tag == "all" else "selected")
    if mode == "all":
        return Selection("all", "all", "evaluate", list(cfg.profile.eval.families), list(cfg.profile.eval.trees))
    tag = f"{cfg.heads.name}-{cfg.tree.name}"
    heads = [] if cfg.heads.get("family") == "none" else [cfg.heads.name]
    return Selection("selected", tag, f"evaluate_{tag}", heads, [None])


def tree_config(cfg: DictConfig, tree_name: str | None, heads_name: str) -> dict:
    """This config's tree, or conf/tree/<name>.yaml resolved for heads_name (tree=optimal is per heads)."""
    if tree_name is None:
        return OmegaConf.to_container(cfg.tree, resolve=True)
    path = REPO_ROOT / "conf" / "tree" / f"{tree_name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ValueError(f"profile.eval.trees names {tree_name!r} but there is no conf/tree/{tree_name}.yaml; known: {known}")
    node = OmegaConf.merge({"paths": cfg.paths, "heads": {"name": heads_name}}, {"tree": OmegaConf.load(path)})
    return OmegaConf.to_container(node, resolve=True)["tree"]


def step_cost_for(tree_cfg: dict, tree: TreeSpec, extra_tokens: int = 0) -> list[float] | None:
    """The relative step costs a `cut_by_cost` tree is cut with (from that latency profile), else None; for steps
    of up to the tree's tokens + extra_tokens (a lookup branch's)."""
    source = tree_cfg.get("cut_by_cost")
    if not source:
        return None
    path = Path(str(source))
    if not path.is_file():
        raise FileNotFoundError(f"tree {tree.name!r}: cut_by_cost={str(path)!r} does not exist; it is written by "
                                "`python -m pipelines.calibrate +task=latency` (dvc stage calibrate_latency)")
    prof = json.loads(path.read_text())
    return relative_step_costs(prof["sizes"], prof["forward_lm_head_s"], prof["baseline_step_s"],
                               tree.num_nodes + 1 + extra_tokens)


def prompt_lookup_drafter(cfg: DictConfig) -> PromptLookupDrafter:
    """Our prompt lookup with eval.prompt_lookup.pld's settings: method `pld`, and the branch of a lookup tree."""
    pld = cfg.eval.prompt_lookup.pld
    return PromptLookupDrafter(int(pld.num_tokens), int(pld.max_ngram), int(pld.min_ngram),
                               None if pld.tokens_per_ngram is None else int(pld.tokens_per_ngram))


def resolve_tree(cfg: DictConfig, tree_cfg: dict, option: str) -> tuple[TreeSpec, list[float] | None, bool]:
    """A resolved conf/tree option -> (its tree, the step costs it is cut with or None, whether prompt lookup's
    chain joins it). A tree cut per step or grown by a lookup branch is named by the option: the file it reads
    (the calibrated tree of optimal or dynamic) is only where it starts."""
    tree = tree_from_config(tree_cfg)
    lookup = bool(tree_cfg.get("lookup"))
    if tree_cfg.get("cut_by_cost") or lookup:
        tree = dataclasses.replace(tree, name=str(tree_cfg.get("name") or option))
    extra = int(cfg.eval.prompt_lookup.pld.num_tokens) if lookup else 0
    return tree, step_cost_for(tree_cfg, tree, extra), lookup


def build_methods(cfg: DictConfig, model, sel: Selection) -> list[Method]:
    methods = [Method("baseline", "baseline", model)]
    for name in sel.heads:
        folder = Path(cfg.paths.results) / "heads" / name
        adapted = (folder / ADAPTER_DIR).is_dir()
        # a LoRA adapter is merged into the backbone: give it its own copy and its own AR reference
        base, heads = load_heads(folder, copy.deepcopy(model) if adapted else model)
        reference = f"baseline-{name}" if adapted else "baseline"
        if adapted:
            methods.append(Method(reference, "reference", base, heads_name=name, family=heads.config.family,
                                  reference=None))
        for tree_name in sel.trees:
            tree_option = tree_name or cfg.tree.name
            tree, step_cost, lookup = resolve_tree(cfg, tree_config(cfg, tree_name, name), tree_option)
            tree.check_heads(heads.config.num_heads)
            methods.append(Method(f"{name}-{tree_option}", "heads", base, heads, tree, name, heads.config.family,
                                  reference, tree_option, step_cost, lookup))
    if cfg.eval.prompt_lookup.enabled:
        methods += [Method("pld", "pld", model, reference="baseline"),
                    Method("pld_hf", "pld_hf", model, reference="baseline")]
    # every model decodes through the CPU fast paths (packed linears, GQA without cache copies), the baselines
    # too; after the LoRA merges, which change the weights
    for m in {id(m.model): m.model for m in methods}.values():
        log.info("prepared %s for decoding: %s", m.config.name_or_path, prepare_for_decoding(m))
    for m in methods:
        if m.heads is not None:
            prepare_heads_for_decoding(m.heads)
    return methods


def tree_question_limits(cfg: DictConfig) -> dict:
    """profile.eval.tree_questions as a dict {tree option: number of questions} ({} when unset)."""
    node = cfg.profile.eval.get("tree_questions")
    return {} if node is None else OmegaConf.to_container(node)


def question_subsets(cfg: DictConfig, methods: list[Method], questions) -> dict[str, set[int]]:
    """{method name: the question ids it runs on} for the methods whose tree is in profile.eval.tree_questions."""
    limits = tree_question_limits(cfg)
    subsets = {}
    for m in methods:
        if m.tree_name in limits and limits[m.tree_name] is not None:
            subsets[m.name] = {q.question_id for q in spread(questions, int(limits[m.tree_name]))}
    return subsets


# -- 2) running one turn ---------------------------------------------------------------------------
def sampling_for(cfg: DictConfig, temperature: float, seed: int) -> SamplingConfig:
    if temperature > 0 and cfg.eval.acceptance == "greedy":
        raise ValueError(f"temperature {temperature} needs eval.acceptance=typical or sampling "
                         "(greedy acceptance ignores the temperature); or use eval.temperature_mode=greedy")
    if temperature <= 0:
        return SamplingConfig(temperature=0.0, acceptance="greedy")
    return SamplingConfig(temperature=temperature, acceptance=cfg.eval.acceptance, epsilon=cfg.eval.typical.epsilon,
                          delta=cfg.eval.typical.delta, seed=seed)


def generate_turn(method: Method, tokenizer, input_ids: list[int], cfg: DictConfig, temperature: float,
                  seed: int, stop_ids: list[int], max_new: int | None = None):
    """One answer by one method -> an object with new_tokens, wall_time, prefill_time, steps, accept_lengths."""
    max_new = int(max_new or cfg.profile.eval.max_new_tokens)
    if method.kind == "pld_hf":
        if temperature > 0:
            torch.manual_seed(seed)
        hf = cfg.eval.prompt_lookup.pld_hf
        return prompt_lookup_generate(method.model, input_ids, max_new, num_tokens=int(hf.num_tokens),
                                      max_ngram=int(hf.max_ngram), temperature=temperature,
                                      stop_token_ids=stop_ids, pad_token_id=tokenizer.pad_token_id)
    lookup = prompt_lookup_drafter(cfg) if method.kind == "pld" or method.lookup else None
    return generate(method.model, tokenizer, input_ids, heads=method.heads, tree=method.tree,
                    sampling=sampling_for(cfg, temperature, seed), max_new_tokens=max_new, stop_token_ids=stop_ids,
                    drafter=lookup if method.kind == "pld" else None, step_cost=method.step_cost,
                    lookup=lookup if method.lookup else None)


def stop_token_ids(model, tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    return sorted(i for i in ids if i is not None)


# -- 3) per-question results: what a killed run keeps ---------------------------------------------------
RECORDS_LAYOUT = 1     # bump when a stored result's layout changes: older ones are then redone


@dataclass
class QuestionResult:
    """One question in one run, all its methods: records[method] = its TurnRecords in turn order, prompts[t - 1]
    = turn t's input ids, answers = the baseline's answer texts (the history a later turn sees)."""
    records: dict[str, list[TurnRecord]]
    prompts: list[list[int]]
    answers: list[str]


def file_digest(path: Path) -> str | None:
    """sha256 of a file, or of every file under a folder with its relative name; None when it does not exist."""
    if not path.exists():
        return None
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
        file_sha256(f, h)
    return h.hexdigest()[:16]


def plain(node):
    """A config node as plain Python, resolved (scalars as they are)."""
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, (DictConfig, ListConfig)) else node


def fingerprint(cfg: DictConfig, sel: Selection, methods: list[Method], questions, device: str) -> tuple[str, dict]:
    """(hash, settings): everything a stored result depends on. The stage's params (dvc.yaml), the questions,
    each method as it decodes (resolved tree, step costs, heads files), the model's files, the code, the
    libraries and the hardware and threads (timings are only comparable there)."""
    methods_now = [{"name": m.name, **m.describe(), "paths": [list(p) for p in m.tree.paths] if m.tree else None,
                    "topk": m.tree.topk if m.tree else None, "step_cost": m.step_cost} for m in methods]
    qtext = json.dumps([[q.question_id, q.category, list(q.turns)] for q in questions])
    settings = {"layout": RECORDS_LAYOUT, "tag": sel.tag, "mode": sel.mode, "seed": int(cfg.seed),
                "model": plain(cfg.model), "profile": {"name": cfg.profile.name, "eval": plain(cfg.profile.eval)},
                "eval": {k: plain(cfg.eval[k]) for k in ("temperature_mode", "category_temperatures", "acceptance",
                                                           "typical", "prompt_lookup", "rotate_order")},
                "questions": hashlib.sha256(qtext.encode()).hexdigest()[:16], "methods": methods_now,
                "files": {str(p): file_digest(p) for p in [Path(str(cfg.model.files))]
                          + [Path(cfg.paths.results) / "heads" / h for h in sel.heads]},
                "code": code_digest("pipelines.evaluate"),
                "versions": {"python": platform.python_version(), "torch": torch.__version__,
                             "transformers": transformers.__version__},
                "device": device, "hardware": hardware(device), "num_threads": torch.get_num_threads()}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16], settings


class RecordStore:
    """Finished (run, question) results as <folder>/r<run>-q<id>.json, each written whole (a temporary file,
    fsync, rename) as soon as its question is done, and manifest.json with the fingerprint they belong to.
    A new fingerprint discards the folder; a file that does not read back as a complete result of this
    fingerprint is redone; a temporary file is never read."""

    def __init__(self, folder: Path, fingerprint: str, settings: dict):
        self.folder, self.fingerprint = Path(folder), fingerprint
        manifest = self.folder / "manifest.json"
        try:
            old = json.loads(manifest.read_text()).get("fingerprint") if manifest.is_file() else None
        except ValueError:
            old = "unreadable"
        if old is not None and old != fingerprint:
            log.warning("evaluate settings, inputs or code changed (fingerprint %s -> %s): discarding the results "
                        "in %s", old, fingerprint, self.folder)
            shutil.rmtree(self.folder)
        write_json(manifest, {"fingerprint": fingerprint, "settings": settings})

    def path(self, run: int, qid: int) -> Path:
        return self.folder / f"r{run}-q{qid}.json"

    def save(self, run: int, qid: int, result: QuestionResult) -> None:
        body = {"fingerprint": self.fingerprint, "run": run, "question_id": qid, "prompts": result.prompts,
                "answers": result.answers,
                "records": {m: [r.as_dict(with_tokens=True) for r in recs] for m, recs in result.records.items()}}
        with atomic_file(self.path(run, qid), fsync=True) as f:  # the result is either complete or absent
            f.write(json.dumps(body))

    def load(self, run: int, qid: int, methods: list[str], turns: int) -> QuestionResult | None:
        """The stored result when it is complete and this fingerprint's, else None (logged: it is redone)."""
        path = self.path(run, qid)
        if not path.is_file():
            return None
        try:
            body = json.loads(path.read_text())
            result = QuestionResult({m: [TurnRecord.from_dict(r) for r in recs] for m, recs in body["records"].items()},
                                    body["prompts"], body["answers"])
            problem = self.problem(body, result, run, qid, methods, turns)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            problem = f"unreadable ({type(err).__name__}: {err})"
        if problem:
            log.warning("evaluate: %s is %s; redoing run %d question %d", path, problem, run, qid)
            return None
        return result

    def problem(self, body: dict, result: QuestionResult, run: int, qid: int, methods: list[str], turns: int):
        if body["fingerprint"] != self.fingerprint or (body["run"], body["question_id"]) != (run, qid):
            return "another run's or settings' result"
        if sorted(result.records) != sorted(methods) or len(result.prompts) != turns or len(result.answers) != turns:
            return f"incomplete (methods {sorted(result.records)}, {len(result.prompts)} turns)"
        for name, recs in result.records.items():
            if [(r.turn, r.run, r.question_id, r.method, r.new_tokens) for r in recs] != \
                    [(t, run, qid, name, len(r.tokens)) for t, r in enumerate(recs, 1)]:
                return f"inconsistent (method {name})"
        return None


# -- 4) the benchmark loop -------------------------------------------------------------------------
def run_question(cfg: DictConfig, order: list[Method], tokenizer, q, run: int, turns: int,
                 stop_ids: list[int]) -> QuestionResult:
    """Every turn of one question by every method in `order`, back to back."""
    temperature = category_temperature(q.category, cfg.eval.temperature_mode,
                                        OmegaConf.to_container(cfg.eval.category_temperatures))
    records: dict[str, list[TurnRecord]] = {m.name: [] for m in order}
    prompts, history = [], []
    for turn in range(1, turns + 1):
        ids = chat_input_ids(tokenizer, list(q.turns[:turn]), history)
        prompts.append(ids)
        seed = cfg.seed + 1000 * run + 10 * q.question_id + turn
        for m in order:
            result = generate_turn(m, tokenizer, ids, cfg, temperature, seed, stop_ids)
            records[m.name].append(TurnRecord.from_generation(q, turn, m.name, run, temperature, result))
        base_tokens = records["baseline"][-1].tokens
        history.append(tokenizer.decode([t for t in base_tokens if t not in stop_ids], skip_special_tokens=True))
    return QuestionResult(records, prompts, history)


def run_benchmark(cfg: DictConfig, methods: list[Method], tokenizer, questions, store: RecordStore,
                  subsets: dict[str, set[int]] | None = None) -> tuple[dict, dict, dict]:
    """records[method][run] = [TurnRecord]; prompts[(run, qid, turn)] = input ids; answers[qid] = turn texts.
    subsets[method name] = the question ids that method runs on (default: all). Questions finished in the store
    are read back, the others decoded and stored as each finishes."""
    ev, stop_ids = cfg.profile.eval, stop_token_ids(methods[0].model, tokenizer)
    records = {m.name: [[] for _ in range(int(ev.repeats))] for m in methods}
    subsets = subsets or {}
    prompts, answers = {}, {}
    plan = []                      # (run, question, its methods in this question's order, turns)
    for run in range(int(ev.repeats)):
        for qi, q in enumerate(questions):
            order = rotated(methods, qi + run) if cfg.eval.rotate_order else methods
            order = [m for m in order if m.name not in subsets or q.question_id in subsets[m.name]]
            plan.append((run, q, order, min(int(ev.turns), len(q.turns))))
    stored = {(run, q.question_id): store.load(run, q.question_id, [m.name for m in order], turns)
              for run, q, order, turns in plan}
    reused = sum(r is not None for r in stored.values())
    log.info("evaluate: %d of %d (run, question) results reused from %s; %d to decode", reused, len(plan),
             store.folder, len(plan) - reused)
    bar = tqdm(total=len(plan), initial=reused, desc="MT-Bench", unit="question")
    warmed = False
    for run, q, order, turns in plan:
        result = stored[(run, q.question_id)]
        if result is None:
            if not warmed:     # allocator, kernels and caches settle; short answers do that as well as long ones
                first = chat_input_ids(tokenizer, [questions[0].turns[0]], [])
                for m in tqdm(methods, desc="warm-up", leave=False):
                    for _ in range(int(ev.warmup)):
                        generate_turn(m, tokenizer, first, cfg, 0.0, cfg.seed, stop_ids,
                                      max_new=min(32, int(ev.max_new_tokens)))
                warmed = True
            result = run_question(cfg, order, tokenizer, q, run, turns, stop_ids)
            store.save(run, q.question_id, result)
        for name, recs in result.records.items():
            records[name][run].extend(recs)
        for turn, ids in enumerate(result.prompts, 1):
            prompts[(run, q.question_id, turn)] = ids
        if run == 0:
            answers[q.question_id] = list(result.answers)
        if stored[(run, q.question_id)] is None:
            bar.update(1)
            bar.set_postfix_str(_speed_postfix(records, run))
    bar.close()
    return records, prompts, answers


def _speed_postfix(records: dict, run: int) -> str:
    base = records["baseline"][run]
    tps = {n: sum(r.new_tokens for r in recs[run]) / max(1e-9, sum(r.wall_time for r in recs[run]))
           for n, recs in records.items() if recs[run]}
    b = tps.get("baseline") or 1.0
    best = max((n for n in tps if n != "baseline"), key=lambda n: tps[n], default=None)
    return f"base {b:.1f} tok/s" + (f", best {best} {tps[best] / b:.2f}x" if best and base else "")


# -- 5) losslessness -------------------------------------------------------------------------------
def check_lossless(methods: list[Method], records: dict, prompts: dict, tolerance: float) -> dict:
    """Every greedy turn of every method against its reference's tokens (the baseline, or the AR run of
    the same adapted backbone). Mismatches at a float tie (|logit gap| <= tolerance) are reported apart."""
    by_name = {m.name: m for m in methods}
    report = {"passed": True, "tie_tolerance": tolerance, "methods": {}, "failures": [], "ties": [],
              "skipped_sampled_turns": 0}
    for m in methods:
        if m.reference is None:
            continue
        ref_model = by_name[m.reference].model
        stats = {"reference": m.reference, "checked_turns": 0, "identical": 0, "ties": 0, "failures": 0}
        for run, (recs, ref_recs) in enumerate(zip(records[m.name], records[m.reference])):
            ref_by_key = {(r.question_id, r.turn): r for r in ref_recs}
            for rec in recs:
                if rec.temperature > 0:
                    report["skipped_sampled_turns"] += 1
                    continue
                ref = ref_by_key[(rec.question_id, rec.turn)]
                stats["checked_turns"] += 1
                pos = first_difference(ref.tokens, rec.tokens)
                if pos is None:
                    stats["identical"] += 1
                    continue
                got = rec.tokens[pos] if pos < len(rec.tokens) else None
                margin = greedy_margin(ref_model, prompts[(run, rec.question_id, rec.turn)], ref.tokens, pos, got)
                entry = {"question_id": rec.question_id, "turn": rec.turn, "run": run, "method": m.name,
                         "reference": m.reference, "position": pos,
                         "expected_token": ref.tokens[pos] if pos < len(ref.tokens) else None, "got_token": got,
                         "expected_length": len(ref.tokens), "got_length": len(rec.tokens), "logit_margin": margin}
                if margin is not None and abs(margin) <= tolerance:
                    stats["ties"] += 1
                    report["ties"].append(entry)
                else:
                    stats["failures"] += 1
                    report["failures"].append(entry)
        report["methods"][m.name] = stats
    report["passed"] = not report["failures"]
    return report


def failure_message(report: dict) -> str:
    lines = [f"losslessness check failed: {len(report['failures'])} greedy turn(s) differ from their reference"]
    for f in report["failures"][:10]:
        lines.append(f"  question {f['question_id']} turn {f['turn']} (run {f['run']}): method {f['method']} differs "
                     f"from {f['reference']} first at new-token position {f['position']} (expected "
                     f"{f['expected_token']}, got {f['got_token']}; lengths {f['expected_length']} vs {f['got_length']})")
    return "\n".join(lines)


# -- 6) summaries and files ------------------------------------------------------------------------
def hardware(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(0)} GPU"
    return f"{os.cpu_count()}-core CPU ({platform.machine()})"


def write_results(cfg: DictConfig, sel: Selection, methods: list[Method], records: dict, answers: dict,
                  lossless: dict, model_name: str, device: str) -> dict:
    out = Path(cfg.paths.results) / "eval" / sel.tag
    ev = cfg.profile.eval
    settings = {"num_questions": len(answers), "turns": int(ev.turns), "max_new_tokens": int(ev.max_new_tokens),
                "repeats": int(ev.repeats), "warmup": int(ev.warmup), "temperature_mode": cfg.eval.temperature_mode,
                "acceptance": cfg.eval.acceptance, "rotate_order": bool(cfg.eval.rotate_order),
                "num_threads": torch.get_num_threads(), "profile": cfg.profile.name, "device": device,
                "tree_questions": tree_question_limits(cfg) if sel.mode == "all" else {},
                "prompt_lookup": OmegaConf.to_container(cfg.eval.prompt_lookup, resolve=True)}
    summary = {"tag": sel.tag, "model": model_name, "hardware": hardware(device), "profile": cfg.profile.name,
               "settings": settings, "baseline": "baseline", "lossless": lossless["passed"], "methods": {}}
    plds = [m.name for m in methods if m.kind in ("pld", "pld_hf")]
    for m in methods:
        s = {**m.describe(), **summarize_method(records[m.name], records["baseline"])}
        if m.kind == "heads":     # the prompt lookups on this method's questions: does it beat the stronger?
            s["pld_speedups"] = {p: speedup_on_questions_of(records[p], records["baseline"], records[m.name])
                                 for p in plds}
        if m.kind == "reference":  # how far the adapted backbone moved: its greedy answers against the base's
            s["agreement_with_base"] = token_agreement([r for run in records[m.name] for r in run],
                                                       [r for run in records["baseline"] for r in run])
        summary["methods"][m.name] = s
        body = {"method": m.name, "model": model_name, "hardware": summary["hardware"], "settings": settings,
                "summary": s, "runs": [[r.as_dict() for r in run] for run in records[m.name]]}
        if m.name == "baseline":
            body["answers"] = {str(q): a for q, a in answers.items()}
        write_json(out / f"{m.name}.json", body)
    write_json(out / "summary.json", summary)
    write_json(out / "lossless_report.json", lossless)
    write_json(Path(cfg.paths.reports) / "metrics" / f"{sel.metrics_name}.json", metrics_of(summary, lossless))
    return summary


def metrics_of(summary: dict, lossless: dict) -> dict:
    """reports/metrics/evaluate*.json: per method both speedups, and the stronger prompt lookup (pld or
    pld_hf, by end-to-end speedup) that "beats prompt lookup" is judged against."""
    base = summary["methods"]["baseline"]
    def ci(s, key):
        return (s.get("intervals") or {}).get(key, {}).get("ci")

    def alt(s, key):
        e = (s.get("intervals") or {}).get(key) or {}
        return {"value": e.get("value"), "ci": e.get("ci")}

    methods = {n: {"speedup": s["speedup"]["mean"], "speedup_ci": ci(s, "speedup"), "speedup_std": s["speedup"]["std"],
                   "decode_speedup": s["decode_speedup"]["mean"], "decode_speedup_ci": ci(s, "decode_speedup"),
                   "decode_speedup_std": s["decode_speedup"]["std"],
                   "speedup_mean_of_ratios": alt(s, "mean_of_ratios"), "speedup_pooled": alt(s, "pooled"),
                   "accept_length": s["accept_length"]["mean"], "accept_length_ci": ci(s, "accept_length"),
                   "tokens_per_s": s["throughput"]["mean"],
                   "decode_tokens_per_s": s["decode_throughput"]["mean"], "questions": s["questions"],
                   "per_category_speedup": {c: v["speedup"]["mean"] for c, v in (s.get("per_category") or {}).items()},
                   **({"pld_speedups": s["pld_speedups"]} if "pld_speedups" in s else {}),
                   **({"agreement_with_base": s["agreement_with_base"]} if "agreement_with_base" in s else {})}
               for n, s in summary["methods"].items() if n != "baseline"}
    plds = [n for n, s in summary["methods"].items()
            if s["kind"] in ("pld", "pld_hf") and s["speedup"]["mean"] is not None]
    best = max(plds, key=lambda n: summary["methods"][n]["speedup"]["mean"], default=None)
    return {"tag": summary["tag"], "lossless": lossless["passed"],
            "lossless_checked_turns": sum(v["checked_turns"] for v in lossless.get("methods", {}).values()),
            "interval": "95% percentile bootstrap over questions (10,000 resamples); speedup: mean per-question "
                        "throughput over the baseline's (Spec-Bench), speedup_mean_of_ratios: mean of per-question "
                        "ratios, speedup_pooled: summed tokens over summed time",
            "num_questions": summary["settings"]["num_questions"],
            "max_new_tokens": summary["settings"]["max_new_tokens"],
            "baseline_tokens_per_s": base["throughput"]["mean"],
            "baseline_decode_tokens_per_s": base["decode_throughput"]["mean"],
            "strongest_pld": best and {"method": best, **{k: methods[best][k] for k in ("speedup", "decode_speedup")}},
            "methods": methods}


def check_protocol(cfg: DictConfig) -> None:
    """profile.eval's counts, each refused with its value and what is accepted before any model is loaded."""
    ev = cfg.profile.eval
    for key, least in (("max_new_tokens", 1), ("turns", 1), ("repeats", 1), ("warmup", 0)):
        v = ev.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ValueError(f"profile.eval.{key}={v!r}: use a whole number >= {least}")
    n = ev.get("num_questions")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"profile.eval.num_questions={n!r}: use a whole number >= 1, or null for all 80")


def run_evaluation(cfg: DictConfig) -> dict:
    """The whole stage; returns the summary. Raises LosslessnessError after writing everything."""
    check_protocol(cfg)
    torch.set_num_threads(int(cfg.eval.num_threads or os.cpu_count() or 1))
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = cfg.eval.device if cfg.eval.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    questions = load_questions(cfg.data.questions_file, cfg.profile.eval.num_questions)
    model, tokenizer = load_model(cfg, device=device)
    sel = selection(cfg)
    methods = build_methods(cfg, model, sel)
    log.info("evaluate (%s, tag %s): %d questions x %d turns x %d runs; methods: %s", sel.mode, sel.tag,
             len(questions), cfg.profile.eval.turns, cfg.profile.eval.repeats, ", ".join(m.name for m in methods))
    with mlflow_run(cfg, "evaluate", run_name=f"evaluate-{sel.tag}"):
        import mlflow

        with torch.inference_mode():
            # the budget cut (profile.eval.tree_questions) is for the full run; a selected method runs on all
            subsets = question_subsets(cfg, methods, questions) if sel.mode == "all" else {}
            store = RecordStore(Path(cfg.paths.data) / "eval-records" / cfg.model.name / sel.tag,
                                *fingerprint(cfg, sel, methods, questions, device))
            records, prompts, answers = run_benchmark(cfg, methods, tokenizer, questions, store, subsets)
        greedy = cfg.eval.temperature_mode == "greedy"
        lossless = check_lossless(methods, records, prompts, float(cfg.eval.lossless_tie_tolerance)) \
            if cfg.eval.check_lossless else {"passed": True, "checked": False, "failures": [], "ties": []}
        lossless["mode"] = "greedy" if greedy else "category temperatures (only T=0 turns checked)"
        summary = write_results(cfg, sel, methods, records, answers, lossless, cfg.model.name, device)
        for name, s in summary["methods"].items():
            key = name.replace("+", "p")
            for metric in ("speedup", "decode_speedup", "accept_length"):
                if s[metric]["mean"] is not None:
                    mlflow.log_metric(f"{metric}.{key}", s[metric]["mean"])
        mlflow.log_metric("lossless", float(lossless["passed"]))
        out = Path(cfg.paths.results) / "eval" / sel.tag
        mlflow.log_artifact(str(out / "summary.json"))
        mlflow.log_artifact(str(out / "lossless_report.json"))
    for name, s in summary["methods"].items():
        if name != "baseline":
            log.info("%-22s speedup %.3fx (decode-only %.3fx)  accepted %.2f tokens/step  (%d questions)", name,
                     s["speedup"]["mean"] or float("nan"), s["decode_speedup"]["mean"] or float("nan"),
                     s["accept_length"]["mean"] or float("nan"), s["questions"])
    if not lossless["passed"]:
        raise LosslessnessError(failure_message(lossless))
    log.info("lossless: all %s greedy turns equal their reference (%d float ties)",
             sum(v["checked_turns"] for v in lossless.get("methods", {}).values()), len(lossless.get("ties", [])))
    return summary


@stage
def main(cfg: DictConfig) -> None:
    run_evaluation(cfg)


if __name__ == "__main__":
    main()
