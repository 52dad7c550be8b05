"""python -m pipelines.calibrate heads=hydra [profile=smoke]     (+task=latency: only the latency profile)

Data-driven trees for one head family on this machine (models/measure/calibration.py has the definitions):
  1) latency profile of the verify step vs tree tokens (results/calibrate/latency.json, one per
     machine and model, shared by the families; measured here when missing)
  2) held-out prompts (val split of the distilled data, topped up from the prepared val split)
     continued greedily by the base model
  3) rank of the base's token in each head's top-k at every position -> acc[d][r]
  4) greedy tree per node budget, and chains (calibrate's chain_lengths); predicted accepted length; step cost = verify(n+1 tokens, from the
     profile) + draft + accept + commit (timed per tree with the decoder's own functions)
  5) the tree or chain with the highest predicted tokens/s -> results/calibrate/<heads>/optimal_tree.json
     (tree=optimal loads it), calibration.json, trees/budget_<n>.json, plots, MLflow run,
     reports/metrics/calibrate_<heads>.json
  6) the tree grown per step: the (depth, top_k, nodes) of profile.calibrate.grown with the highest predicted
     tokens/s -> dynamic_tree.json (tree=dynamic_optimal loads it), dynamic_* in the metrics (calibrate_grown.py)

DVC runs it on the composed params.yaml with `+select.heads=<name>` (pipelines/common.py).
"""
from __future__ import annotations

from pipelines import omp  # noqa: F401,I001  (first: OpenMP's wait policy is read when torch loads)
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from models.measure.calibration import (accuracy_table, choose_budget, empirical_accept_length, greedy_continuations,
                                greedy_tree, model_fingerprint,
                                predicted_accept_length, predicted_tokens_per_s, replay_accept_length,
                                sequence_ranks, sort_paths, step_timings, top1_unconditional,
                                batch_draft_timings)
from models.engine.path_choice import applied_paths, prepare_for_decoding
from models.hardware import host_record, machine_description
from models.measure.latency import (batch_verify_profile, interpolate_cost, train_step_seconds, verify_latency_profile,
                                    weight_read_seconds)
from models.engine.trees import TreeSpec, chain_tree, tree_from_config
from pipelines.calibrate_batch import BATCH_FILE, batch_choices, write_batch_trees
from pipelines.calibrate_grown import DYNAMIC_FILE, grown_rows, write_grown
from pipelines.calibrate_plots import plot_calibration, plot_latency
from pipelines.common import (conf_option, flat_metrics, heads_options, load_model, log, mlflow_run, run_record,
                              stage, write_json)
from pipelines.host import apply_host, static_step

FIXED_TREES = ("chain4", "sparse64")   # the papers' tree and the chain, predicted for comparison


# -- machine setup -----------------------------------------------------------------------------

def setup_device(cfg: DictConfig) -> str:
    """Device and torch threads as the evaluation uses them (the tree is chosen for that setup)."""
    c = cfg.profile.calibrate
    torch.set_num_threads(int(c.num_threads or os.cpu_count() or 1))
    device = ("cuda" if torch.cuda.is_available() else "cpu") if c.device == "auto" else str(c.device)
    apply_host(cfg, device)                     # on CUDA: 1 host thread, cuDNN attention off (conf host.*)
    return device


# -- latency profile ---------------------------------------------------------------------------

def latency_path(cfg: DictConfig) -> Path:
    return Path(cfg.paths.results) / "calibrate" / "latency.json"


def measure_latency(cfg: DictConfig, model, device: str) -> dict:
    c = cfg.profile.calibrate
    sizes = [int(n) for n in c.latency_sizes]
    if 1 not in sizes:
        raise ValueError(f"profile.calibrate.latency_sizes={sizes} must include 1 (the autoregressive baseline's step)")
    log.info("verify latency: sizes %s, %d repeats, %d-token prefix", sizes, c.latency_repeats, c.latency_prefix)
    prof = verify_latency_profile(model, sizes, int(c.latency_repeats), int(c.latency_prefix),
                                  static=static_step(cfg, device))
    record = {"model": cfg.model.name, "dtype": cfg.model.dtype, "machine": machine_description(device),
              "prefix_len": int(c.latency_prefix), "repeats": int(c.latency_repeats), "statistic": "median",
              "sizes": sizes, "seconds": prof["forward_s"],                          # verify forward, no LM head
              "forward_lm_head_s": prof["forward_lm_head_s"],
              "baseline_step_s": prof["forward_lm_head_s"][sizes.index(1)],          # 1 token + LM head + argmax
              "all_forward_lm_head_s": prof["all_forward_lm_head_s"]}
    record["weight_read"] = weight_read_seconds(model, int(c.latency_repeats))     # the memory-bound floor
    record["train_step"] = train_step_seconds(model)     # the compute-bound unit the train stages' rates are read in
    record["omp_wait"] = host_record(device)["omp_wait"]          # worth a quarter of a quiet CPU step (docs/engine.md)
    record["paths"] = applied_paths(model)      # the CPU paths measured fastest here (models/engine/path_choice.py)
    batch_sizes = [int(b) for b in (c.get("batch_sizes") or [1])]
    if batch_sizes != [1]:                       # the batched verify step, for the tree per batch size
        log.info("batched verify: batch sizes %s", batch_sizes)
        record["batch"] = batch_verify_profile(model, batch_sizes, sizes, int(c.latency_repeats), int(c.latency_prefix))
    record["run"] = run_record()                 # the commit, the machine and this stage's time, as metrics carry
    write_json(latency_path(cfg), record)
    # the machine's two units, committed with the run: the cost model's rates are read against them
    # (python -m pipelines.cost --rates)
    write_json(Path(cfg.paths.reports) / "metrics" / "calibrate_latency.json",
               {k: record[k] for k in ("model", "machine", "baseline_step_s", "weight_read", "train_step", "omp_wait", "paths",
                                "run")})
    plot_latency(record, latency_path(cfg).with_suffix(".png"))
    return record


def load_latency(cfg: DictConfig, model, device: str) -> dict:
    """The saved profile when it is for this model and machine; measured (and saved) when missing."""
    path = latency_path(cfg)
    if not path.is_file():
        log.warning("%s is missing: measuring it now (`dvc repro calibrate_latency` makes it a stage output)", path)
        return measure_latency(cfg, model, device)
    record = json.loads(path.read_text())
    here = machine_description(device)
    if record.get("model") != cfg.model.name:
        raise ValueError(f"{path} was measured for model {record.get('model')!r}, not {cfg.model.name!r}; "
                         "re-run `python -m pipelines.calibrate +task=latency`")
    changed = {k: (record["machine"].get(k), v) for k, v in here.items() if record["machine"].get(k) != v}
    if changed:
        log.warning("%s was measured on another machine or setup (%s); re-run `dvc repro -f calibrate_latency` "
                    "for this one", path, changed)
    return record


# -- data --------------------------------------------------------------------------------------

def first_turn(row, max_prompt_tokens: int) -> tuple[list[int], list[int]] | None:
    """(prompt, reply): the chat template up to the first assistant header, and that reply's tokens."""
    labels = row["labels"]
    start = next((i for i, y in enumerate(labels) if y != -100), None)
    if start is None or start > max_prompt_tokens:
        return None
    end = next((i for i in range(start, len(labels)) if labels[i] == -100), len(labels))
    return list(row["input_ids"][:start]), list(row["input_ids"][start:end])


def held_out_turns(cfg: DictConfig) -> list[tuple[list[int], list[int]]]:
    """First turns of num_samples held-out conversations: the distilled val split, then (greedy
    continuation only, where the data's answers are not used) other prompts of the prepared val
    split, which no training stage saw either."""
    from datasets import load_from_disk

    c = cfg.profile.calibrate
    folder = Path(cfg.data.distilled_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"distilled data {folder} does not exist; run `dvc repro distill` first")
    sources = [load_from_disk(str(folder))["val"]]
    if c.continuation == "greedy" and Path(cfg.data.prepared_dir).is_dir():
        sources.append(load_from_disk(str(cfg.data.prepared_dir))["val"])
    turns, seen = [], set()
    for split in sources:
        for row in split:
            turn = first_turn(row, int(c.max_prompt_tokens))
            if turn is None or tuple(turn[0]) in seen:
                continue
            seen.add(tuple(turn[0]))
            turns.append(turn)
            if len(turns) == c.num_samples:
                return turns
    if not turns:
        raise ValueError(f"no val row of {folder} has an assistant reply after a prompt of at most "
                         f"{c.max_prompt_tokens} tokens (profile.calibrate.max_prompt_tokens)")
    log.warning("only %d usable held-out prompts (profile.calibrate.num_samples=%d)", len(turns), c.num_samples)
    return turns


def cached_continuations(cfg: DictConfig, model, tokenizer, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy continuations, computed once per model weights (Medusa-2 merges its adapter: other weights)
    and reused by the families that share them, in results/cache/calibrate/ (a cache, not a DVC output)."""
    from models.engine.decoding import resolve_stop_ids

    stops = sorted(resolve_stop_ids(model, tokenizer))
    max_new = int(cfg.profile.calibrate.max_new_tokens)
    key = hashlib.sha256(json.dumps({"model": model_fingerprint(model), "prompts": prompts, "stops": stops,
                                     "max_new_tokens": max_new}).encode()).hexdigest()[:16]
    path = Path(cfg.paths.results) / "cache" / "calibrate" / f"{cfg.model.name}-{key}.json"
    if path.is_file():
        log.info("greedy continuations from %s", path)
        return json.loads(path.read_text())["sequences"]
    t0 = time.perf_counter()
    seqs = greedy_continuations(model, prompts, max_new, stops,
                                static=static_step(cfg, next(model.parameters()).device))
    write_json(path, {"model": cfg.model.name, "max_new_tokens": max_new, "sequences": seqs})
    log.info("%d greedy continuations in %.0f s -> %s", len(seqs), time.perf_counter() - t0, path)
    return seqs


# -- trees and costs ---------------------------------------------------------------------------

def fixed_tree(cfg: DictConfig, name: str) -> TreeSpec:
    return tree_from_config(OmegaConf.to_container(conf_option("tree", name)))


def evaluate_tree(spec: TreeSpec, acc, ranks, latency: dict, model, heads, cfg: DictConfig) -> dict:
    """Predicted accepted length (formula and replays), step cost and tokens/s of one tree."""
    c = cfg.profile.calibrate
    paths = [list(p) for p in spec.paths]
    L = predicted_accept_length(acc, paths)
    verify_s = interpolate_cost(latency["sizes"], latency["seconds"], spec.num_nodes + 1)
    parts = step_timings(model, heads, spec, int(c.latency_repeats), int(c.latency_prefix))
    overhead_s = parts["draft"] + parts["lm_head"] + parts["accept"] + parts["commit"]
    tps = predicted_tokens_per_s(L, verify_s, overhead_s)
    return {"budget": spec.num_nodes, "depth": spec.depth, "predicted_accept_length": L,
            "empirical_accept_length": empirical_accept_length(ranks, paths, spec.top_k),
            "replay_accept_length": replay_accept_length(ranks, paths, spec.top_k),
            "verify_s": verify_s, "overhead_s": overhead_s, "step_parts_s": parts,
            "predicted_step_s": verify_s + overhead_s, "predicted_tokens_per_s": tps,
            "predicted_speedup": tps * latency["baseline_step_s"], "paths": sort_paths(spec.paths)}


def add_batch_drafting(cfg: DictConfig, rows: list[dict], batch: dict | None, model, heads) -> None:
    """Each candidate's batched draft at every batch size > 1 of the batch profile ("batch_draft_s": {B: s}), which
    the tree per batch size is chosen with (calibrate_batch.py)."""
    sizes = [int(b) for b in (batch or {}).get("batch_sizes", []) if int(b) > 1]
    c, K = cfg.profile.calibrate, int(cfg.profile.calibrate.top_k)
    for row in rows if sizes else []:
        spec = TreeSpec(f"{cfg.heads.name}_b{row['budget']}", tuple(tuple(p) for p in row["paths"]), K)
        row["batch_draft_s"] = batch_draft_timings(model, heads, spec, sizes, int(c.latency_repeats),
                                                   int(c.latency_prefix))


# -- the stage ---------------------------------------------------------------------------------

def calibration_sequences(cfg: DictConfig, model, tokenizer) -> tuple[list, list]:
    """(prompts, sequences): held-out prompts and each with the base model's greedy answer (or the data's own)."""
    c = cfg.profile.calibrate
    turns = held_out_turns(cfg)
    prompts = [p for p, _ in turns]
    if c.continuation == "greedy":
        return prompts, cached_continuations(cfg, model, tokenizer, prompts)
    if c.continuation == "data":     # positions off the greedy path are skipped (models/measure/calibration.py)
        return prompts, [p + r[:int(c.max_new_tokens)] for p, r in turns]
    raise ValueError(f"profile.calibrate.continuation={c.continuation!r}; use greedy or data")


def chain_lengths(budgets, depth: int) -> list[int]:
    """The chains calibrate weighs beside the greedy trees: one per budget the heads reach, and the deepest (a block
    drafter's whole block verified as a chain, as DFlash's authors verify it)."""
    return sorted({int(n) for n in budgets if int(n) <= depth} | {int(depth)})


def tree_rows(cfg: DictConfig, acc, ranks, latency, model, heads) -> tuple[list, list, dict, float]:
    """(a row per greedy tree of each budget, a row per chain of chain_lengths, {fixed tree name: its row} for the
    fixed trees the heads can draft, how the verify forwards timed now compare with the latency profile)."""
    K, D = int(cfg.profile.calibrate.top_k), heads.config.num_heads
    rows = [evaluate_tree(TreeSpec(f"{cfg.heads.name}_budget{n}", tuple(greedy_tree(acc, int(n))), K), acc, ranks,
                          latency, model, heads, cfg) for n in cfg.profile.calibrate.budgets]
    chains = [dict(evaluate_tree(chain_tree(n, K, f"{cfg.heads.name}_chain{n}"), acc, ranks, latency, model, heads,
                                 cfg), shape="chain") for n in chain_lengths(cfg.profile.calibrate.budgets, D)]
    fixed = {}
    for name in FIXED_TREES:
        spec = fixed_tree(cfg, name)
        if spec.depth <= D and spec.top_k == K:
            fixed[name] = evaluate_tree(spec, acc, ranks, latency, model, heads, cfg)
    # the profile and the step timings are taken minutes apart: on a shared machine they can disagree
    drift = float(np.median([r["step_parts_s"]["verify"] / r["verify_s"] for r in rows]))
    if not 2 / 3 < drift < 3 / 2:
        log.warning("the verify forwards timed now take %.2fx the latency profile's (%s): the machine's load "
                    "changed since it was measured; predicted tokens/s are unreliable (re-run on a quiet machine: "
                    "`dvc repro -f calibrate_latency calibrate`)", drift, latency_path(cfg))
    return rows, chains, fixed, drift


def write_calibration(cfg: DictConfig, result: dict, rows: list, chosen: dict, acc) -> tuple[dict, list]:
    """Every budget's tree, optimal_tree.json (what tree=optimal loads), calibration.json, the metrics and the
    plots; -> (metrics, written files)."""
    out, K = Path(cfg.paths.results) / "calibrate" / cfg.heads.name, result["top_k"]
    shutil.rmtree(out / "trees", ignore_errors=True)          # no stale budgets from an earlier run
    out.mkdir(parents=True, exist_ok=True)
    for row in rows + result["chains"]:
        shape = "chain" if row.get("shape") == "chain" else "budget"
        write_json(out / "trees" / f"{shape}_{row['budget']}.json",
                   {"name": f"{cfg.heads.name}_{shape}{row['budget']}", "paths": row["paths"], "top_k": K,
                    "budget": row["budget"], "predicted_accept_length": row["predicted_accept_length"]})
    write_json(out / "optimal_tree.json", {
        "name": "optimal", "paths": chosen["paths"], "top_k": K, "budget": chosen["budget"],
        "predicted_accept_length": chosen["predicted_accept_length"],
        "predicted_tokens_per_s": chosen["predicted_tokens_per_s"], "heads": cfg.heads.name,
        "machine": result["machine"]})
    write_json(out / "calibration.json", result)
    metrics = {k: chosen[k] for k in ("predicted_accept_length", "replay_accept_length", "predicted_tokens_per_s",
                                      "predicted_speedup")}
    metrics = {"chosen_budget": chosen["budget"], "chosen_shape": chosen.get("shape", "tree"), **metrics, "acc_top1": [float(a) for a in acc[:, 0]],
               **write_grown(cfg, result["grown"], out, result["machine"]),          # tree=dynamic_optimal
               **write_batch_trees(out, cfg.heads.name, result["batch"], K),          # the batch curve's trees
               "host": host_record(result["machine"]["device"]), "run": run_record()}
    metrics["choice"] = write_choice(out, metrics)
    write_json(Path(cfg.paths.reports) / "metrics" / f"calibrate_{cfg.heads.name}.json", metrics)
    pngs = plot_calibration(result, out)
    tree_from_config({"kind": "file", "file": str(out / "optimal_tree.json")}).check_heads(result["num_heads"])
    batch = [out / BATCH_FILE] if result["batch"] else []
    return metrics, [out / "optimal_tree.json", out / DYNAMIC_FILE, out / CHOICE_FILE, *batch, out / "calibration.json",
                     *pngs]


CHOICE_FILE = "choice.json"


def write_choice(out: Path, metrics: dict) -> str:
    """choice.json: which of the two calibrated trees, the fixed one (tree=optimal) or the one grown per step
    (tree=dynamic_optimal), is predicted the faster here; the evaluation runs that one on every question."""
    fixed, grown = metrics["predicted_tokens_per_s"], metrics["dynamic_predicted_tokens_per_s"]
    choice = "grown" if grown > fixed else "fixed"
    write_json(out / CHOICE_FILE, {"choice": choice, "fixed_predicted_tokens_per_s": fixed,
                                   "grown_predicted_tokens_per_s": grown})
    return choice


def calibrate(cfg: DictConfig) -> dict:
    from models.methods import load_for_decoding

    torch.manual_seed(cfg.seed)
    device = setup_device(cfg)
    base, tokenizer = load_model(cfg, device=device)
    model, heads, _ = load_for_decoding(Path(cfg.paths.results) / "heads" / cfg.heads.name, base)   # LoRA merged
    latency = load_latency(cfg, model, device)
    D, K, name = heads.config.num_heads, int(cfg.profile.calibrate.top_k), cfg.heads.name
    t0 = time.perf_counter()
    prompts, seqs = calibration_sequences(cfg, model, tokenizer)                         # 1) sequences
    ranks = [sequence_ranks(model, heads, s, len(p) - 1, K) for s, p in zip(seqs, prompts) if len(s) >= len(p) + 1]
    if not ranks:                                                                         # 2) ranks, accuracies
        raise ValueError("every continuation is empty: nothing to calibrate on")
    acc, counts = accuracy_table(ranks, K)
    log.info("%s: %d sequences, %d positions in %.0f s; acc[d][0] = %s", name, len(ranks), int(counts[0]),
             time.perf_counter() - t0, np.round(acc[:, 0], 3).tolist())
    rows, chains, fixed, drift = tree_rows(cfg, acc, ranks, latency, model, heads)       # 3) trees, cost, choice
    chosen = choose_budget(rows + chains)
    add_batch_drafting(cfg, rows + chains, latency.get("batch"), model, heads)
    grown = grown_rows(cfg, model, heads, prompts, seqs, latency)
    result = {
        "heads": name, "family": heads.config.family, "model": cfg.model.name, "top_k": K, "num_heads": D,
        "draft_vocab_size": heads.config.draft_vocab_size, "continuation": cfg.profile.calibrate.continuation,
        "num_sequences": len(ranks), "num_positions": int(counts[0]), "acc": acc.tolist(),
        "acc_counts": counts.tolist(), "top1_unconditional": top1_unconditional(ranks),
        "machine": latency["machine"], "latency_file": str(latency_path(cfg)),
        "baseline_tokens_per_s": 1.0 / latency["baseline_step_s"], "verify_now_vs_profile": drift, "budgets": rows,
        "chains": chains, "fixed_trees": fixed, "chosen_budget": chosen["budget"],
        "chosen_shape": chosen.get("shape", "tree"), "chosen": {k: v for k, v in chosen.items() if k != "paths"},
        "grown": grown,                                                            # the tree grown per step
        "batch": batch_choices(rows + chains, latency.get("batch"), grown),      # the tree per batch size
    }
    metrics, files = write_calibration(cfg, result, rows, chosen, acc)                   # 4) outputs
    if chosen["predicted_speedup"] < 1:
        log.warning("%s: even the best tree is predicted slower than the autoregressive baseline (%.2fx): "
                    "the heads are rarely right (acc[d][0] = %s) or drafting costs too much here",
                    name, chosen["predicted_speedup"], np.round(acc[:, 0], 3).tolist())
    log.info("%s: chosen budget %d, predicted %.2f tokens/step, %.1f tokens/s (%.2fx); %s", name, chosen["budget"],
             chosen["predicted_accept_length"], chosen["predicted_tokens_per_s"], chosen["predicted_speedup"], files[0])
    return {"result": result, "metrics": metrics, "files": files}


@stage
def main(cfg: DictConfig) -> None:
    task = cfg.get("task", "trees")
    if task == "latency":
        with mlflow_run(cfg, "calibrate", run_name="calibrate-latency"):
            import mlflow

            device = setup_device(cfg)
            model, _ = load_model(cfg, device=device)
            prepare_for_decoding(model)
            record = measure_latency(cfg, model, device)
            mlflow.log_metrics({f"verify_ms_{n}": 1e3 * s for n, s in zip(record["sizes"], record["seconds"])})
            mlflow.log_artifact(str(latency_path(cfg)))
            mlflow.log_artifact(str(latency_path(cfg).with_suffix(".png")))
        return
    if task != "trees":
        raise ValueError(f"task={task!r} is not known; use +task=latency or leave it out (trees)")
    if cfg.heads.family == "none":
        raise ValueError(f"heads=none has no draft heads to calibrate; use heads=<one of {heads_options()}>")
    with mlflow_run(cfg, "calibrate", run_name=f"calibrate-{cfg.heads.name}"):
        import mlflow

        log_calibration(calibrate(cfg))


def log_calibration(done: dict) -> None:
    """calibrate()'s metrics and per-budget predictions into the active MLflow run."""
    import mlflow

    m = done["metrics"]
    mlflow.log_metrics(flat_metrics(m))
    mlflow.log_metrics({f"acc_top1_d{d + 1}": v for d, v in enumerate(m["acc_top1"])})
    for row in done["result"]["budgets"]:
        mlflow.log_metrics({"budget_predicted_accept_length": row["predicted_accept_length"],
                            "budget_replay_accept_length": row["replay_accept_length"],
                            "budget_predicted_tokens_per_s": row["predicted_tokens_per_s"]}, step=row["budget"])
    for path in done["files"]:
        mlflow.log_artifact(str(path))


if __name__ == "__main__":
    main()
