"""The calibrate stage's choice of the tree grown per step (tree=dynamic_optimal, dynamic_optimal_pld): for each
(depth, top_k, nodes) of profile.calibrate.grown, the accepted length replayed along the held-out sequences
(models/measure/grown_calibration.py) and the step cost on this machine; the best by predicted tokens/s is
written to results/calibrate/<heads>/dynamic_tree.json beside the fixed trees.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from models.engine.drafting import GrownTreeDrafter
from models.engine.trees import GrownTree
from models.measure.calibration import predicted_tokens_per_s, step_timings
from models.measure.grown_calibration import accepted_drafts, choose_grown, grown_settings, replay_grown, visited_steps
from models.measure.latency import interpolate_cost
from pipelines.common import log, write_json

DYNAMIC_FILE = "dynamic_tree.json"
METRIC_KEYS = ("depth", "top_k", "nodes", "predicted_accept_length", "predicted_tokens_per_s", "predicted_speedup")


def grown_rows(cfg: DictConfig, model, heads, prompts: list, seqs: list, latency: dict) -> list[dict]:
    """A row per (depth, top_k, nodes) setting: replayed accepted length, step cost, predicted tokens/s."""
    c, g = cfg.profile.calibrate, cfg.profile.calibrate.grown
    max_levels = GrownTreeDrafter(heads, GrownTree("probe", 0, 1, 1)).max_levels
    settings = grown_settings(g.depth, g.top_k, g.nodes, max_levels)
    pairs = [(s, p) for s, p in zip(seqs, prompts) if len(s) >= len(p) + 1]
    rows = []
    for top_k in sorted({k for _, k, _ in settings}):
        t0 = time.perf_counter()
        deepest = max(d for d, k, _ in settings if k == top_k)
        replay = replay_grown(model, heads, [s for s, _ in pairs], [len(p) - 1 for _, p in pairs], top_k, deepest,
                              int(g.every))
        log.info("grown tree top_k %d: %d positions replayed in %.0f s", top_k, len(replay.path_levels),
                 time.perf_counter() - t0)
        for depth, k, nodes in (s for s in settings if s[1] == top_k):
            tree = GrownTree(f"{cfg.heads.name}_grown_d{depth}_k{k}_n{nodes}", depth, k, nodes)
            drafts = min(nodes, k + depth * k * k)
            drafted = accepted_drafts(replay, depth + 1, nodes)
            L = float(np.mean(visited_steps(replay, drafted)))       # along the positions decoding visits
            verify_s = interpolate_cost(latency["sizes"], latency["seconds"], drafts + 1)
            parts = step_timings(model, heads, tree, int(c.latency_repeats), int(c.latency_prefix))
            overhead_s = parts["draft"] + parts["lm_head"] + parts["accept"] + parts["commit"]
            tps = predicted_tokens_per_s(L, verify_s, overhead_s)
            rows.append({"depth": depth, "top_k": k, "nodes": nodes, "drafts": drafts,
                         "positions": len(replay.path_levels),
                         "predicted_accept_length": L, "every_position_accept_length": 1.0 + float(drafted.mean()), "verify_s": verify_s, "overhead_s": overhead_s,
                         "step_parts_s": parts, "predicted_tokens_per_s": tps,
                         "predicted_speedup": tps * latency["baseline_step_s"]})
    return rows


def write_grown(cfg: DictConfig, rows: list[dict], out: Path, machine: dict) -> dict:
    """dynamic_tree.json (what tree=dynamic_optimal loads) -> the metrics of the chosen setting (dynamic_*)."""
    chosen = choose_grown(rows)
    write_json(out / DYNAMIC_FILE, {"kind": "grown", "name": "dynamic_optimal", "heads": cfg.heads.name,
                                    **{k: chosen[k] for k in METRIC_KEYS}, "machine": machine})
    log.info("%s: grown tree depth %d, top_k %d, nodes %d: predicted %.2f tokens/step, %.2fx", cfg.heads.name,
             chosen["depth"], chosen["top_k"], chosen["nodes"], chosen["predicted_accept_length"],
             chosen["predicted_speedup"])
    return {f"dynamic_{k}": chosen[k] for k in METRIC_KEYS}
