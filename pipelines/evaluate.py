"""python -m pipelines.evaluate [heads=hydra_pp tree=sparse64] [profile=smoke] [eval.methods=heads|references|...]

MT-Bench speed evaluation at batch size 1, the methods of one run (eval.methods) in this one process:
  baseline                 autoregressive decoding with the base model (heads=None)
  <heads>-<tree>           each trained heads folder results/heads/<heads> on each tree; a tree with
                           `lookup: true` (optimal_pld, cut_pld) merges prompt lookup's chain into it
  pld                      prompt lookup decoding in our decoder (models/engine/drafters/prompt_lookup.py): the same
                           loop and decode step as the heads (eval.prompt_lookup.pld)
  pld_hf                   prompt lookup decoding in transformers' generate, the reference
                           (eval.prompt_lookup.pld_hf); a method beats prompt lookup if it beats both
  hf_generate              transformers' own greedy generate, no drafting (eval.hf_generate): the other
                           autoregressive loop beside the baseline, its tokens checked equal to the baseline's
  <draft model>_hf         transformers' assisted generation with a draft-model family's model (eval.sps_hf),
                           the reference of <draft model>-<tree>
  baseline-<heads>         autoregressive reference of a backbone changed by a LoRA adapter (Medusa-2):
                           only used to check that family's losslessness, not a table entry
Which heads and trees: eval.methods (conf/eval/mtbench.yaml). In DVC each family has its own stage,
evaluate@<heads> (eval.methods=heads): the baseline and those heads on every tree of profile.eval.trees, written to
results/eval/<heads>/ and reports/metrics/evaluate_<heads>.json; the stage `references` (eval.methods=references)
runs the baseline, both prompt lookups and hf_generate into results/eval/references/. Every speedup is over its
own run's baseline; pipelines.tables pairs methods of different runs by question through those ratios. By hand,
`heads=hydra_pp tree=sparse64` runs that one method beside the prompt lookups (results/eval/<heads>-<tree>/), and
eval.methods=all every family x tree in one process (results/eval/all/).

Protocol (docs/reference.md#evaluation-protocol): profile.eval.turns turns per question (turn 2 sees turn 1's answer:
the baseline's, so every method gets the same prompt), warm-up generations first, greedy unless
eval.temperature_mode=category; for each question the methods run back to back, their order rotated
from question to question, so machine drift cancels in the ratios; profile.eval.repeats runs. Every
turn records its prefill and decode time: speedups end to end and decode-only (models/measure/benchmark.py).
In a heads or all run a tree in profile.eval.tree_questions runs on that many of the
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
import hashlib
import json
import os
import platform
import random
from pathlib import Path

import torch
import transformers
from omegaconf import DictConfig, ListConfig, OmegaConf
from tqdm import tqdm

from models.engine.decoding import SamplingConfig, generate
from models.measure.benchmark import TurnRecord, speedup_on_questions_of, summarize_method, token_agreement
from models.measure.mtbench import category_temperature, chat_input_ids, load_questions, rotated
from models.measure.peers import assisted_generate, greedy_generate, prompt_lookup_generate
from models.measure.lossless import LosslessnessError, check_lossless, failure_message
from models.measure.records import QuestionResult, RecordStore, file_digest
from models.measure.stage_metrics import metrics_of
from models.hardware import applied_host_settings, host_record, machine_label
from pipelines.common import load_model, log, mlflow_run, run_record, stage, stop_token_ids, write_json
from pipelines.stage_clock import StageClock
from pipelines.host import apply_host, static_step
from pipelines.deps import code_digest
from pipelines.methods import (SWEEP_MODES, Contender, Kind, Selection, build_methods, drafter_for, question_subsets,
                               selection, tree_question_limits)



# -- 1) running one turn ---------------------------------------------------------------------------
def sampling_for(cfg: DictConfig, temperature: float, seed: int) -> SamplingConfig:
    if temperature > 0 and cfg.eval.acceptance == "greedy":
        raise ValueError(f"temperature {temperature} needs eval.acceptance=typical or sampling "
                         "(greedy acceptance ignores the temperature); or use eval.temperature_mode=greedy")
    if temperature <= 0:
        return SamplingConfig(temperature=0.0, acceptance="greedy")
    return SamplingConfig(temperature=temperature, acceptance=cfg.eval.acceptance, epsilon=cfg.eval.typical.epsilon,
                          delta=cfg.eval.typical.delta, seed=seed)


def generate_turn(method: Contender, tokenizer, input_ids: list[int], cfg: DictConfig, temperature: float,
                  seed: int, stop_ids: list[int], max_new: int | None = None):
    """One answer by one method -> an object with new_tokens, wall_time, prefill_time, steps, accept_lengths."""
    max_new = int(max_new or cfg.profile.eval.max_new_tokens)
    if method.kind is Kind.SPS_HF:
        if temperature > 0:
            torch.manual_seed(seed)
        return assisted_generate(method.model, method.assistant, input_ids, max_new,
                                 num_tokens=int(cfg.eval.sps_hf.num_tokens), temperature=temperature,
                                 stop_token_ids=stop_ids, pad_token_id=tokenizer.pad_token_id)
    if method.kind is Kind.HF_GENERATE:
        if temperature > 0:
            torch.manual_seed(seed)
        return greedy_generate(method.model, input_ids, max_new, temperature=temperature, stop_token_ids=stop_ids,
                               pad_token_id=tokenizer.pad_token_id)
    if method.kind is Kind.PLD_HF:
        if temperature > 0:
            torch.manual_seed(seed)
        hf = cfg.eval.prompt_lookup.pld_hf
        return prompt_lookup_generate(method.model, input_ids, max_new, num_tokens=int(hf.num_tokens),
                                      max_ngram=int(hf.max_ngram), temperature=temperature,
                                      stop_token_ids=stop_ids, pad_token_id=tokenizer.pad_token_id)
    return generate(method.model, tokenizer, input_ids, drafter_for(method, cfg),
                    sampling=sampling_for(cfg, temperature, seed), max_new_tokens=max_new, stop_token_ids=stop_ids,
                    static=static_step(cfg, next(method.model.parameters()).device))


# -- 2) what stored results belong to ------------------------------------------------------------
RECORDS_LAYOUT = 1     # bump when a stored result's layout changes: older ones are then redone


def plain(node):
    """A config node as plain Python, resolved (scalars as they are)."""
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, (DictConfig, ListConfig)) else node


def fingerprint(cfg: DictConfig, sel: Selection, methods: list[Contender], questions, device: str,
                subsets: dict[str, set[int]] | None = None) -> tuple[str, dict]:
    """(hash, settings): everything a stored result depends on. The stage's params (dvc.yaml), the questions,
    each method as it decodes (resolved tree, step costs, heads files), the model's files, the code, the
    libraries and the hardware and threads (timings are only comparable there)."""
    methods_now = [{"name": m.name, **m.describe(), "step_cost": m.step_cost,     # a grown tree: describe()'s "grown"
                    "paths": [list(p) for p in getattr(m.tree, "paths", ())] if m.tree else None,
                    "top_k": getattr(m.tree, "top_k", None)} for m in methods]
    qtext = json.dumps([[q.question_id, q.category, list(q.turns)] for q in questions])
    settings = {"layout": RECORDS_LAYOUT, "tag": sel.tag, "mode": sel.mode, "seed": int(cfg.seed),
                "model": plain(cfg.model), "profile": {"name": cfg.profile.name, "eval": plain(cfg.profile.eval)},
                "eval": {k: plain(cfg.eval.get(k)) for k in ("temperature_mode", "category_temperatures", "acceptance",
                                                               "typical", "prompt_lookup", "sps_hf", "rotate_order", "drafters")},
                "questions": hashlib.sha256(qtext.encode()).hexdigest()[:16], "methods": methods_now,
                "subsets": {name: sorted(ids) for name, ids in sorted((subsets or {}).items())},
                "files": {str(p): file_digest(p) for p in [Path(str(cfg.model.files))]
                          + [Path(cfg.paths.results) / "heads" / h for h in sel.heads]},
                "code": code_digest("pipelines.evaluate"),
                "versions": {"python": platform.python_version(), "torch": torch.__version__,
                             "transformers": transformers.__version__},
                "device": device, "hardware": machine_label(device), "num_threads": torch.get_num_threads(),
                **({"host": host} if (host := applied_host_settings(device)) else {})}   # CUDA's only
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16], settings



# -- 3) the benchmark loop -------------------------------------------------------------------------
def run_question(cfg: DictConfig, order: list[Contender], tokenizer, q, run: int, turns: int,
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


def run_benchmark(cfg: DictConfig, methods: list[Contender], tokenizer, questions, store: RecordStore,
                  subsets: dict[str, set[int]] | None = None,
                  clock: StageClock | None = None) -> tuple[dict, dict, dict]:
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
            if clock:
                clock.save()
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


# -- 4) summaries and files ------------------------------------------------------------------------
def write_results(cfg: DictConfig, sel: Selection, methods: list[Contender], records: dict, answers: dict,
                  lossless: dict, model_name: str, device: str, clock: StageClock | None = None) -> dict:
    out = Path(cfg.paths.results) / "eval" / sel.tag
    ev = cfg.profile.eval
    settings = {"num_questions": len(answers), "turns": int(ev.turns), "max_new_tokens": int(ev.max_new_tokens),
                "repeats": int(ev.repeats), "warmup": int(ev.warmup), "temperature_mode": cfg.eval.temperature_mode,
                "acceptance": cfg.eval.acceptance, "rotate_order": bool(cfg.eval.rotate_order),
                "num_threads": torch.get_num_threads(), "profile": cfg.profile.name, "device": device,
                "tree_questions": tree_question_limits(cfg) if sel.mode in SWEEP_MODES else {},
                "prompt_lookup": OmegaConf.to_container(cfg.eval.prompt_lookup, resolve=True)}
    summary = {"tag": sel.tag, "model": model_name, "hardware": machine_label(device), "profile": cfg.profile.name,
               "settings": settings, "baseline": "baseline", "lossless": lossless["passed"], "methods": {}}
    plds = [m.name for m in methods if m.kind.prompt_lookup]
    for m in methods:
        s = {**m.describe(), **summarize_method(records[m.name], records["baseline"])}
        if m.kind is Kind.HEADS:     # the prompt lookups on this method's questions: does it beat the stronger?
            s["pld_speedups"] = {p: speedup_on_questions_of(records[p], records["baseline"], records[m.name])
                                 for p in plds}
        if m.kind is Kind.REFERENCE:  # how far the adapted backbone moved: its greedy answers against the base's
            s["agreement_with_base"] = token_agreement([r for run in records[m.name] for r in run],
                                                       [r for run in records["baseline"] for r in run])
        summary["methods"][m.name] = s
        body = {"method": m.name, "model": model_name, "hardware": summary["hardware"], "settings": settings,
                "summary": s, "runs": [[r.as_dict() for r in run] for run in records[m.name]]}
        if m.name == "baseline":
            body["answers"] = {str(q): a for q, a in answers.items()}
        if m.kind.greedy_reference:     # the greedy first turns the batch curve's answers must equal
            body["first_turn_tokens"] = {str(r.question_id): r.tokens for r in records[m.name][0] if r.turn == 1}
        write_json(out / f"{m.name}.json", body)
    write_json(out / "summary.json", summary)
    write_json(out / "lossless_report.json", lossless)
    metrics = {**metrics_of(summary, lossless, per_question=sel.mode != "all"), "host": host_record(device),
               "run": clock.finish(run_record()) if clock else run_record()}
    write_json(Path(cfg.paths.reports) / "metrics" / f"{sel.metrics_name}.json", metrics)
    return summary


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
    apply_host(cfg, device)                     # on CUDA: 1 host thread, cuDNN attention off (conf host.*)
    questions = load_questions(cfg.data.questions_file, cfg.profile.eval.num_questions)
    model, tokenizer = load_model(cfg, device=device)
    sel = selection(cfg)
    methods = build_methods(cfg, model, sel)
    log.info("evaluate (%s, tag %s): %d questions x %d turns x %d runs; methods: %s", sel.mode, sel.tag,
             len(questions), cfg.profile.eval.turns, cfg.profile.eval.repeats, ", ".join(m.name for m in methods))
    with mlflow_run(cfg, "evaluate", run_name=f"evaluate-{sel.tag}"):
        import mlflow

        with torch.inference_mode():
            # the budget cut (profile.eval.tree_questions) is for the tree sweeps; a selected method runs on all
            subsets = question_subsets(cfg, methods, questions) if sel.mode in SWEEP_MODES else {}
            store = RecordStore(Path(cfg.paths.data) / "eval-records" / cfg.model.name / sel.tag,
                                *fingerprint(cfg, sel, methods, questions, device, subsets))
            clock = StageClock(store.folder)         # the stage's time over every invocation its records took
            records, prompts, answers = run_benchmark(cfg, methods, tokenizer, questions, store, subsets, clock)
        greedy = cfg.eval.temperature_mode == "greedy"
        lossless = check_lossless(methods, records, prompts, float(cfg.eval.lossless_tie_tolerance)) \
            if cfg.eval.check_lossless else {"passed": True, "checked": False, "failures": [], "ties": []}
        lossless["mode"] = "greedy" if greedy else "category temperatures (only T=0 turns checked)"
        summary = write_results(cfg, sel, methods, records, answers, lossless, cfg.model.name, device, clock)
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
