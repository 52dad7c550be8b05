"""python -m pipelines.evaluate_batch heads=<h>        (dvc: batch@<heads>; heads=none: batch_baseline)

The batch curve: the profile's MT-Bench questions (first turns, greedy, profile.eval.max_new_tokens new tokens)
decoded in consecutive batches of B, in question order (models/engine/batch.py), for each B > 1 of
profile.eval.batch_sizes:
  heads=none   the autoregressive baseline                                            -> results/batch/baseline/
  heads=<h>    the heads on their tree for B (results/calibrate/<h>/batch_trees.json), alone (<h>-batch) and with
               prompt lookup's chain merged in (<h>-batch_pld)                          -> results/batch/<h>/
With profile.eval.batch_questions = N, the curve decodes N of those questions, spread over the categories (every
B and every method the same N, the baseline's included). A B above the number of questions is refused before any
model loads (it would decode one smaller batch and record it under B). With profile.eval.batch_lookup_sizes set,
<h>-batch_pld runs at those B only.
B = 1 is the headline's (evaluate@<h>, references): not decoded again. The first batch
of each B runs once untimed (warm-up). A batch's record: its questions, its wall seconds (prefills included), each
answer's tokens and accepted lengths. Every answer must be the references stage's greedy batch-1 answer
(results/eval/references/baseline.json), token for token, or a float tie by the evaluation's rule
(eval.lossless_tie_tolerance; reported with its margin); the stage fails after writing everything otherwise. The
baseline runs in its own stage, once for every method: a method's ratio pairs its batch with the baseline's batch of
the same questions across the two stages (analysis/batch_curve.py). Resumable: each (method, B) is written whole
when done to data/batch-records/<model.name>/<tag>/, and a rerun with the same fingerprint reads it back.
"""
from __future__ import annotations

from pipelines import omp  # noqa: F401,I001  (first: OpenMP's wait policy is read when torch loads)
import hashlib
import json
import os
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from models.engine.batch import generate_batch
from models.engine.drafting import make_drafter
from models.engine.path_choice import prepare_for_decoding
from models.engine.trees import TreeOption, check_spelling, tree_option
from models.hardware import host_record, machine_label
from models.measure.lossless import LosslessnessError, judged_difference
from models.measure.mtbench import chat_input_ids, load_questions, spread
from models.methods import load_for_decoding
from pipelines.common import load_model, log, mlflow_run, run_record, stage, stop_token_ids, write_json
from pipelines.stage_clock import StageClock
from pipelines.deps import code_digest
from pipelines.host import apply_host
from pipelines.methods import heads_spec


def batch_sizes(cfg: DictConfig) -> list[int]:
    sizes = [int(b) for b in cfg.profile.eval.get("batch_sizes") or [1]]
    if any(b < 1 for b in sizes) or len(set(sizes)) != len(sizes):
        raise ValueError(f"profile.eval.batch_sizes={sizes}: use distinct whole numbers >= 1")
    return [b for b in sizes if b > 1]


def curve_questions(cfg: DictConfig, questions: list) -> list:
    """The questions the batch curve decodes: profile.eval.batch_questions of the profile's, spread over the
    categories (null: every one)."""
    n = cfg.profile.eval.get("batch_questions")
    if n is not None and int(n) < 1:
        raise ValueError(f"profile.eval.batch_questions={n}: use a whole number >= 1, or null for every question")
    return spread(questions, None if n is None else int(n))


def check_question_count(cfg: DictConfig, n: int) -> None:
    """Every B of profile.eval.batch_sizes fits in the n questions the curve decodes: a larger B would decode one
    smaller batch and record it under B."""
    sizes = [int(b) for b in cfg.profile.eval.get("batch_sizes") or [1]]
    too_big, asked = [b for b in sizes if b > n], cfg.profile.eval.get("num_questions")
    if too_big:
        subset = cfg.profile.eval.get("batch_questions")
        raise ValueError(f"profile.eval.batch_sizes={sizes} asks for B={max(too_big)} but profile.eval.num_questions="
                         f"{'null (all)' if asked is None else asked}"
                         + ("" if subset is None else f" and profile.eval.batch_questions={subset}")
                         + f" select{'s' if subset is None else ''} {n} questions; use batch sizes at most {n} or more questions")


def method_sizes(cfg: DictConfig, name: str, sizes: list[int]) -> list[int]:
    """The batch sizes a method runs at: every B of the curve, but prompt lookup merged in (<h>-batch_pld) only at
    those of profile.eval.batch_lookup_sizes when it is set (each such cell costs as much as the heads' alone)."""
    lookup = cfg.profile.eval.get("batch_lookup_sizes")
    if not name.endswith("-batch_pld") or lookup is None:
        return sizes
    unknown = sorted(set(int(b) for b in lookup) - set(sizes) - {1})
    if unknown:
        raise ValueError(f"profile.eval.batch_lookup_sizes={list(lookup)} names {unknown}, not batch sizes of "
                         f"profile.eval.batch_sizes={list(cfg.profile.eval.batch_sizes)}; use some of those")
    return [b for b in sizes if b in {int(x) for x in lookup}]


def reference_answers(cfg: DictConfig, adapted: bool) -> dict[int, list[int]]:
    """{question id: the greedy first-turn tokens the answers must equal}: the references stage's baseline, or for
    heads that adapt the backbone (Medusa-2's LoRA) their own stage's run of that backbone alone."""
    folder = Path(cfg.paths.results) / "eval"
    path = folder / cfg.heads.name / f"baseline-{cfg.heads.name}.json" if adapted else \
        folder / "references" / "baseline.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the batch curve checks every answer against it (`dvc repro "
                                f"{'evaluate@' + cfg.heads.name if adapted else 'references'}`)")
    tokens = json.loads(path.read_text()).get("first_turn_tokens")
    if tokens is None:
        raise ValueError(f"{path} holds no first_turn_tokens (written by an older evaluate): rerun that stage")
    return {int(q): t for q, t in tokens.items()}


def methods_for(cfg: DictConfig, model) -> tuple[object, bool, dict]:
    """(model, whether the heads adapted it, {method name: new_drafter(B) -> a fresh drafter, or None})."""
    if cfg.heads.family == "none":
        prepare_for_decoding(model)
        return model, False, {"baseline": None}
    folder = Path(cfg.paths.results)
    model, heads, adapted = load_for_decoding(folder / "heads" / cfg.heads.name, model)
    trees_file = folder / "calibrate" / cfg.heads.name / "batch_trees.json"
    if not trees_file.is_file():
        raise FileNotFoundError(f"{trees_file} is missing: `dvc repro calibrate@{cfg.heads.name}` writes the tree "
                                "for each batch size (profile.eval.batch_sizes)")
    trees = json.loads(trees_file.read_text())["trees"]

    def option_for(B: int, lookup: bool) -> TreeOption:
        if str(B) not in trees:
            raise ValueError(f"{trees_file} has trees for batch sizes {sorted(trees, key=int)}, not {B}: rerun "
                             f"calibrate@{cfg.heads.name} with these profile.eval.batch_sizes")
        t = trees[str(B)]
        check_spelling(t, f"{trees_file}: the tree for B={B}")
        # a grown tree: each sequence grows its own, under the same node budget
        keys = ("depth", "top_k", "nodes") if t.get("kind") == "grown" else ("paths", "top_k")
        return tree_option({"kind": t.get("kind", "paths"), "name": f"batch_b{B}", "lookup": lookup,
                            **{k: t[k] for k in keys if k in t}})

    name = cfg.heads.name
    return model, bool(adapted), {
        f"{name}-batch": lambda B: make_drafter(heads_spec(cfg, option_for(B, False)), heads=heads),
        f"{name}-batch_pld": lambda B: make_drafter(heads_spec(cfg, option_for(B, True)), heads=heads)}


def decode_batches(model, prompts: list[list[int]], qids: list[int], B: int, new_drafter, max_new: int,
                   stops: list[int]) -> list[dict]:
    """Every batch of B consecutive questions once: its wall seconds and answers."""
    if B > len(prompts):                # the first batch would be smaller than B, and recorded under B
        raise ValueError(f"batches of {B} from {len(prompts)} questions: B must be at most the number of questions")
    generate_batch(model, None, prompts[:B], [new_drafter(B) for _ in prompts[:B]] if new_drafter else None,
                   max_new_tokens=min(8, max_new), stop_token_ids=stops)                       # warm-up
    out = []
    for i in range(0, len(prompts), B):
        chunk = prompts[i:i + B]
        drafters = [new_drafter(B) for _ in chunk] if new_drafter else None
        t0 = time.perf_counter()
        res = generate_batch(model, None, chunk, drafters, max_new_tokens=max_new, stop_token_ids=stops)
        out.append({"questions": qids[i:i + B], "wall_time": time.perf_counter() - t0,
                    "answers": [{"tokens": r.new_tokens, "accept_lengths": r.accept_lengths, "steps": r.steps}
                                for r in res]})
    return out


def lossless_check(model, prompts: dict, refs: dict, batches: list[dict], floor: float) -> dict:
    """Each answer against its reference: identical, a tie (with its margin) or a failure."""
    report = {"checked": 0, "identical": 0, "ties": [], "failures": []}
    for batch in batches:
        for q, a in zip(batch["questions"], batch["answers"]):
            report["checked"] += 1
            entry = judged_difference(model, prompts[q], refs[q], a["tokens"], a["accept_lengths"], floor)
            if entry is None:
                report["identical"] += 1
            else:
                report["ties" if entry["tie"] else "failures"].append({"question_id": q, **entry})
    return report


def fingerprint(cfg: DictConfig, names: list[str], sizes: list[int], device: str) -> str:
    keys = {"params": OmegaConf.to_container(cfg.profile.eval, resolve=True), "heads": cfg.heads.name,
            "methods": names, "sizes": sizes, "code": code_digest("pipelines.evaluate_batch"), "device": device,
            "threads": torch.get_num_threads(), "model": cfg.model.name}
    return hashlib.sha256(json.dumps(keys, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_batch_curve(cfg: DictConfig) -> dict:
    torch.set_num_threads(int(cfg.eval.num_threads or os.cpu_count() or 1))
    device = cfg.eval.device if cfg.eval.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    apply_host(cfg, device)
    sizes = batch_sizes(cfg)
    questions = curve_questions(cfg, load_questions(cfg.data.questions_file, cfg.profile.eval.num_questions))
    check_question_count(cfg, len(questions))                  # before any model loads
    base, tok = load_model(cfg, device=device)
    model, adapted, methods = methods_for(cfg, base)
    refs = reference_answers(cfg, adapted)
    questions = [q for q in questions if q.question_id in refs]
    prompts = {q.question_id: chat_input_ids(tok, q.turns[:1], []) for q in questions}
    qids, stops = [q.question_id for q in questions], stop_token_ids(model, tok)
    tag = "baseline" if cfg.heads.family == "none" else cfg.heads.name
    store = Path(cfg.paths.data) / "batch-records" / cfg.model.name / tag / fingerprint(cfg, list(methods), sizes,
                                                                                        device)
    out, results = Path(cfg.paths.results) / "batch" / tag, {}
    clock = StageClock(store)                    # the stage's time over every invocation its cells took
    with mlflow_run(cfg, "evaluate_batch", run_name=f"batch-{tag}"), torch.inference_mode():
        import mlflow

        for name, new_drafter in methods.items():
            for B in method_sizes(cfg, name, sizes):
                path = store / f"{name}_b{B}.json"
                if not path.is_file():
                    log.info("%s: %d questions in batches of %d", name, len(qids), B)
                    batches = decode_batches(model, [prompts[q] for q in qids], qids, B, new_drafter,
                                             int(cfg.profile.eval.max_new_tokens), stops)
                    write_json(path, {"method": name, "batch_size": B, "batches": batches})
                    clock.save()
                batches = json.loads(path.read_text())["batches"]
                check = lossless_check(model, prompts, refs, batches, float(cfg.eval.lossless_tie_tolerance))
                tokens = sum(len(a["tokens"]) for b in batches for a in b["answers"])
                wall = sum(b["wall_time"] for b in batches)
                results.setdefault(name, {})[str(B)] = {"tokens": tokens, "wall_time": wall, "lossless": check,
                                                        "batches": batches}
                mlflow.log_metric(f"tokens_per_s.{name}.b{B}", tokens / wall)
                log.info("%s B=%d: %.1f tokens/s; %d answers identical, %d ties, %d failures", name, B,
                         tokens / wall, check["identical"], len(check["ties"]), len(check["failures"]))
    passed = all(not r["lossless"]["failures"] for m in results.values() for r in m.values())
    summary = {"tag": tag, "model": cfg.model.name, "hardware": machine_label(device), "batch_sizes": sizes,
               "max_new_tokens": int(cfg.profile.eval.max_new_tokens), "questions": qids, "lossless": passed,
               "methods": results}
    write_json(out / "batch.json", summary)
    write_json(Path(cfg.paths.reports) / "metrics" / f"batch_{tag}.json", {
        "lossless": passed, "host": host_record(device), "run": clock.finish(run_record()),
        "tokens_per_s": {m: {B: r["tokens"] / r["wall_time"] for B, r in rs.items()} for m, rs in results.items()}})
    if not passed:
        raise LosslessnessError(f"batch curve {tag}: answers differ from the references stage's beyond a float tie "
                                f"({out / 'batch.json'}, lossless.failures)")
    return summary


@stage
def main(cfg: DictConfig) -> None:
    run_batch_curve(cfg)


if __name__ == "__main__":
    main()
