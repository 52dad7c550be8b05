"""python -m pipelines.bench.tree_oracle heads=eagle3 [+oracle.settings=[[5,10,59]]]
(make bench-oracle ORACLE_HEADS="eagle eagle3")

A benchmark, not a stage: how far is the tree grown per step (tree=dynamic_optimal) from a tree of the same size
chosen in hindsight, on the evaluation's own answers? Reads evaluate@<heads>'s per-question records
(data/eval-records/<model>/<heads>/: each question's prompt, its greedy reference answer and every method's tokens
per step), replays the calibrated grown tree along each answer (models/measure/tree_oracle.py), checks the replay's
steps against those the decoder recorded, and compares, paired over questions (tokens a step):

  grown / fixed      as decoded: <heads>-dynamic_optimal against <heads>-optimal
  oracle / grown     the same candidates and node budget, keeping the base's path: what the ranking costs
  oracle / fixed     what a grown tree of this size could give over the fixed tree at best
  ceiling / fixed    every candidate kept (no node budget): what the drafts themselves hold

+oracle.settings adds (depth, top_k, nodes) settings replayed the same way, e.g. the authors' EAGLE-2 default
[5, 10, 59] (no decoded counterpart: the replay stands for it). Needs `dvc repro evaluate@<heads>` first. Prints
the table and writes reports/bench/tree_oracle_<heads>.json.
"""
from __future__ import annotations

from pipelines import omp  # noqa: F401,I001  (first: OpenMP's wait policy is read when torch loads)
import json
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from models.engine.trees import GrownTree
from models.methods import load_for_decoding
from models.measure.grown_calibration import accepted_drafts, replay_grown
from models.measure.intervals import paired_comparison
from models.measure.tree_oracle import candidate_drafts, oracle_drafts, steps_agree, walk_steps
from pipelines.common import load_model, log, stage, write_json
from pipelines.methods import resolve_tree, tree_config


def load_records(folder: Path, reference: str) -> dict[int, dict]:
    """{question id: turn 1's prompt ids, the reference's greedy tokens, {method: tokens per step}} from the
    evaluation's stored records (run 0)."""
    files = sorted(folder.glob("r0-q*.json"))
    if not files:
        raise FileNotFoundError(f"no evaluation records in {folder}: run `dvc repro evaluate@{folder.name}` first")
    out = {}
    for f in files:
        body = json.loads(f.read_text())
        recs = body["records"]
        if reference not in recs:
            raise ValueError(f"{f} has no {reference!r} answer (it has {sorted(recs)})")
        out[int(body["question_id"])] = {"prompt": body["prompts"][0], "answer": recs[reference][0]["tokens"],
                                         "steps": {m: r[0]["accept_lengths"] for m, r in recs.items()}}
    return out


def mean_step(steps: list[int]) -> float:
    return float(np.mean(steps)) if steps else float("nan")


def replay_setting(model, heads, records: dict[int, dict], depth: int, top_k: int, nodes: int) -> dict[int, dict]:
    """{question: {grown, oracle, ceiling: tokens per step as decoding would visit, grown_steps}} for one setting."""
    levels, out = depth + 1, {}
    for qid, r in records.items():
        seq, start = list(r["prompt"]) + list(r["answer"]), len(r["prompt"]) - 1
        replay = replay_grown(model, heads, [seq], [start], top_k, depth)
        grown = walk_steps(accepted_drafts(replay, levels, nodes))
        out[qid] = {"grown": mean_step(grown), "grown_steps": grown,
                    "oracle": mean_step(walk_steps(oracle_drafts(replay, levels, nodes))),
                    "ceiling": mean_step(walk_steps(candidate_drafts(replay, levels)))}
    return out


def compare(a: dict[int, float], b: dict[int, float]) -> dict:
    c = paired_comparison(a, b)
    return {k: c[k] for k in ("questions", "ratio", "interval", "wins", "losses")}


def summarise(name: str, setting: tuple[int, int, int], rows: dict[int, dict], records: dict[int, dict],
              decoded: bool) -> dict:
    """Means and paired comparisons of one setting; `decoded`: the setting is the one evaluate decoded."""
    pick = lambda key: {q: r[key] for q, r in rows.items()}  # noqa: E731
    fixed = {q: mean_step(r["steps"][f"{name}-optimal"]) for q, r in records.items() if f"{name}-optimal" in r["steps"]}
    out = {"depth": setting[0], "top_k": setting[1], "nodes": setting[2],
           "mean": {k: float(np.mean(list(pick(k).values()))) for k in ("grown", "oracle", "ceiling")},
           "oracle_over_grown": compare(pick("oracle"), pick("grown")),
           "oracle_over_fixed": compare(pick("oracle"), fixed), "ceiling_over_fixed": compare(pick("ceiling"), fixed),
           "replayed_grown_over_fixed": compare(pick("grown"), fixed)}
    out["mean"]["fixed_decoded"] = float(np.mean(list(fixed.values()))) if fixed else None
    method = f"{name}-dynamic_optimal"
    if decoded and all(method in r["steps"] for r in records.values()):
        measured = {q: mean_step(r["steps"][method]) for q, r in records.items()}
        out["mean"]["grown_decoded"] = float(np.mean(list(measured.values())))
        out["grown_over_fixed_decoded"] = compare(measured, fixed)
        out["replay_agrees"] = sum(steps_agree(rows[q]["grown_steps"], r["steps"][method], tail=setting[0] + 2)
                                   for q, r in records.items())
    return out


def print_summary(name: str, s: dict, questions: int) -> None:
    ci = lambda c: f"{c['ratio']:.3f}x [{c['interval'][0]:.3f}, {c['interval'][1]:.3f}]" if c["ratio"] else "-"  # noqa: E731
    m = s["mean"]
    print(f"\n{name}: grown tree depth {s['depth']}, top_k {s['top_k']}, nodes {s['nodes']}; {questions} questions")
    print(f"  tokens a step: fixed (decoded) {m['fixed_decoded'] or float('nan'):.3f}, grown (replayed) "
          f"{m['grown']:.3f}" + (f", grown (decoded) {m['grown_decoded']:.3f}" if "grown_decoded" in m else "")
          + f", oracle {m['oracle']:.3f}, ceiling {m['ceiling']:.3f}")
    if "replay_agrees" in s:
        print(f"  replay equals the decoder's steps on {s['replay_agrees']} of {questions} questions; "
              f"grown / fixed (decoded) {ci(s['grown_over_fixed_decoded'])}")
    print(f"  oracle / grown {ci(s['oracle_over_grown'])}; oracle / fixed {ci(s['oracle_over_fixed'])}; "
          f"ceiling / fixed {ci(s['ceiling_over_fixed'])}")


@stage
def main(cfg: DictConfig) -> None:
    name = str(cfg.heads.name)
    model, _ = load_model(cfg)
    model, heads, adapted = load_for_decoding(Path(cfg.paths.results) / "heads" / name, model)
    records = load_records(Path(cfg.paths.data) / "eval-records" / cfg.model.name / name,
                           f"baseline-{name}" if adapted else "baseline")
    tree = resolve_tree(cfg, tree_config(cfg, "dynamic_optimal", name), "dynamic_optimal").tree
    if not isinstance(tree, GrownTree):
        raise ValueError(f"tree=dynamic_optimal resolved to {type(tree).__name__}, not a grown tree")
    extra = [tuple(int(x) for x in s) for s in (OmegaConf.select(cfg, "oracle.settings", default=None) or [])]
    settings = [(tree.depth, tree.top_k, tree.nodes)] + [s for s in extra if s != (tree.depth, tree.top_k, tree.nodes)]
    result = {"heads": name, "questions": len(records), "settings": []}
    with torch.inference_mode():
        for i, setting in enumerate(settings):
            t0 = time.perf_counter()
            rows = replay_setting(model, heads, records, *setting)
            s = summarise(name, setting, rows, records, decoded=i == 0)
            s["seconds"] = round(time.perf_counter() - t0, 1)
            s["per_question"] = {q: {k: r[k] for k in ("grown", "oracle", "ceiling")} for q, r in rows.items()}
            result["settings"].append(s)
            print_summary(name, s, len(records))
    path = write_json(Path(cfg.paths.reports) / "bench" / f"tree_oracle_{name}.json", result)
    log.info("wrote %s", path)


if __name__ == "__main__":
    main()
