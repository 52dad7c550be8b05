"""The calibrate stage's tree per batch size (the batch curve's, pipelines/evaluate_batch.py): of the greedy trees and
chains weighed for batch 1, the one with the most predicted tokens/s when B sequences decode together, from the
batched verify profile (results/calibrate/latency.json "batch", models.measure.latency.batch_verify_profile):

    tokens/s at B = B x L / (verify_B(n + 1) + B x overhead)

L the tree's predicted accepted length, verify_B the batched forward of B rows of n + 1 tokens with the LM head on
every row (one product for the batch, as models/engine/batch.py runs it), overhead the tree's drafting, acceptance
and commit: the batch's draft as measured for B drafters drafting together (calibrate's batch_draft_s), or B
drafts one after another, and acceptance and commit once a sequence, the LM head left out. The candidates are the
fixed trees and chains weighed for batch 1 and the grown-tree settings (each sequence grows its own). Written to
results/calibrate/<heads>/batch_trees.json ({B: the tree}), which the batch curve decodes each B with.
"""
from __future__ import annotations

from pathlib import Path

from models.measure.latency import interpolate_cost
from pipelines.common import log, write_json

BATCH_FILE = "batch_trees.json"


def own_seconds(row: dict, B: int) -> float:
    """A step's drafting, acceptance and commit for B sequences: the batched draft where it was measured
    (batch_draft_s), else B drafts one after another (a grown tree: each sequence grows its own); acceptance and
    commit once a sequence."""
    parts = row.get("step_parts_s") or {}
    if not parts:
        return B * row["overhead_s"]
    draft = (row.get("batch_draft_s") or {}).get(str(B))
    return (B * parts["draft"] if draft is None else draft) + B * (parts["accept"] + parts["commit"])


def batch_choices(rows: list[dict], batch: dict | None, grown: list[dict] = ()) -> dict[str, dict]:
    """{B: the chosen tree and its prediction} for each batch size of the profile, among the fixed trees and chains
    (rows) and the grown-tree settings (grown); none without a batch profile."""
    if not batch:
        return {}
    out = {}
    candidates = [*rows, *(dict(g, budget=g["drafts"], shape="grown") for g in grown)]
    for B, seconds in zip(batch["batch_sizes"], batch["seconds"]):
        def tps(row):
            verify = interpolate_cost(batch["sizes"], seconds, row["budget"] + 1)
            return B * row["predicted_accept_length"] / (verify + own_seconds(row, B))
        best = max(candidates, key=lambda r: (tps(r), -r["budget"]))
        tree = {"kind": "grown", **{k: best[k] for k in ("depth", "top_k", "nodes")}} if best.get("shape") == "grown" \
            else {"paths": best["paths"], "top_k": best.get("top_k", 10)}
        out[str(B)] = {"name": f"batch_optimal_b{B}", **tree, "budget": best["budget"],
                       "shape": best.get("shape", "tree"), "predicted_accept_length": best["predicted_accept_length"],
                       "predicted_tokens_per_s": tps(best)}
    return out


def write_batch_trees(folder: Path, heads: str, choices: dict[str, dict], top_k: int) -> dict:
    """batch_trees.json -> the metrics ({batch_chosen_budget: {B: nodes}})."""
    if not choices:
        (folder / BATCH_FILE).unlink(missing_ok=True)          # none from an earlier run with batch sizes
        return {}
    write_json(folder / BATCH_FILE, {"heads": heads, "trees": {B: {"top_k": top_k, **c} for B, c in choices.items()}})
    log.info("%s: trees per batch size %s", heads, {B: c["budget"] for B, c in choices.items()})
    return {"batch_chosen_budget": {B: c["budget"] for B, c in choices.items()}}
