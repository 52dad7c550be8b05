"""The calibrate stage's tree per batch size (the batch curve's, pipelines/evaluate_batch.py): of the greedy trees and
chains weighed for batch 1, the one with the most predicted tokens/s when B sequences decode together, from the
batched verify profile (results/calibrate/latency.json "batch", models.measure.latency.batch_verify_profile):

    tokens/s at B = B x L / (verify_B(n + 1) + B x overhead)

L the tree's predicted accepted length, verify_B the batched forward of B rows of n + 1 tokens with the LM head on
every row (one product for the batch, as models/engine/batch.py runs it), overhead the tree's drafting, acceptance
and commit at batch 1, its LM head left out (a batch drafts one sequence at a time). Written to
results/calibrate/<heads>/batch_trees.json ({B: the tree}), which the batch curve decodes each B with.
"""
from __future__ import annotations

from pathlib import Path

from models.measure.latency import interpolate_cost
from pipelines.common import log, write_json

BATCH_FILE = "batch_trees.json"


def batch_choices(rows: list[dict], batch: dict | None) -> dict[str, dict]:
    """{B: the chosen row's tree and prediction} for each batch size of the profile (none without one)."""
    if not batch:
        return {}
    out = {}
    for B, seconds in zip(batch["batch_sizes"], batch["seconds"]):
        def tps(row):
            verify = interpolate_cost(batch["sizes"], seconds, row["budget"] + 1)
            parts = row.get("step_parts_s") or {}
            own = sum(parts[k] for k in ("draft", "accept", "commit")) if parts else row["overhead_s"]
            return B * row["predicted_accept_length"] / (verify + B * own)
        best = max(rows, key=lambda r: (tps(r), -r["budget"]))
        out[str(B)] = {"name": f"batch_optimal_b{B}", "paths": best["paths"], "topk": best.get("topk", 10),
                       "budget": best["budget"], "shape": best.get("shape", "tree"),
                       "predicted_accept_length": best["predicted_accept_length"],
                       "predicted_tokens_per_s": tps(best)}
    return out


def write_batch_trees(folder: Path, heads: str, choices: dict[str, dict], topk: int) -> dict:
    """batch_trees.json -> the metrics ({batch_chosen_budget: {B: nodes}})."""
    if not choices:
        (folder / BATCH_FILE).unlink(missing_ok=True)          # none from an earlier run with batch sizes
        return {}
    write_json(folder / BATCH_FILE, {"heads": heads, "trees": {B: {**c, "topk": topk} for B, c in choices.items()}})
    log.info("%s: trees per batch size %s", heads, {B: c["budget"] for B, c in choices.items()})
    return {"batch_chosen_budget": {B: c["budget"] for B, c in choices.items()}}
