"""What the papers' acceptance would give in this decoder on a GPU: a projection, not a reproduction.

For each published result, the published accepted tokens a step divided by what a step of that method's tree costs
in this decoder at a paper's shape, relative to a plain (1-token) step, as a GPU bench file measured it
(reports/bench/gpu_<device>.json, `make bench-gpu`); the published speedup beside it. The cost is the measured
step of that family on that tree where the file has it under the chosen host settings, else the verify profile
at the tree's token count alone (drafting left out: the projection is then an upper bound, and says so).

    rows = projection_rows(json.load(open("reports/bench/gpu_h100_2026-11-26.json")))
    text = projection_section(bench, "reports/bench/gpu_h100_2026-11-26.json")
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from analysis.published import published_value

# (method, published table, base model, our family, tree in the bench file, tokens a step verifies). Every one
# but EAGLE-2/3 verifies the 63-node tree (64 tokens with the root; EAGLE-1's default tree is the same one);
# EAGLE-2 and EAGLE-3 rebuild a 60-token tree every step (docs/reference.md, trees). Medusa-2 decodes as
# Medusa-1 does (its LoRA merged into the base). The EAGLE-3 paper gives no Vicuna-7B row: its LLaMA-3.1-8B one is
# the nearest to a 7B shape. Vicuna-7B rows come from the paper of the method, EAGLE and EAGLE-2 from Spec-Bench.
# DFlash verifies its block of 16 as a chain (15 drafts and the root): its paper's Qwen3-8B row.
PUBLISHED_STEPS = [
    ("medusa1", "medusa", "Vicuna-7B", "medusa", "sparse64", 64),
    ("medusa2", "medusa", "Vicuna-7B", "medusa", "sparse64", 64),
    ("hydra", "hydra", "Vicuna-7B", "hydra", "sparse64", 64),
    ("hydra_pp", "hydra", "Vicuna-7B", "hydra_pp", "sparse64", 64),
    ("eagle", "specbench_2025", "Vicuna-7B", "eagle", "sparse64", 64),
    ("eagle2", "specbench_2025", "Vicuna-7B", "eagle", "eagle2", 60),
    ("eagle3", "eagle3", "LLaMA-3.1-8B", "eagle3", "eagle2", 60),
    ("dflash", "dflash", "Qwen3-8B", "dflash", "chain15", 16),
]
LABELS = {"medusa1": "Medusa-1", "medusa2": "Medusa-2", "hydra": "Hydra", "hydra_pp": "Hydra++", "eagle": "EAGLE",
          "eagle2": "EAGLE-2", "eagle3": "EAGLE-3", "dflash": "DFlash"}
SHAPE = "vicuna_7b"                                  # the papers' 7B shape
# The decoder at its GPU pace where the file measured it. With host.static_step the decoder replays each fixed tree's
# draft as a CUDA graph (static_drafts); the bench's static_step setting keeps them eager only to compare.
SETTINGS_PREFERRED = ("static_drafts", "static_step", "host_settings")


def chosen_setting(bench: dict, shape: str = SHAPE) -> str:
    """The first of SETTINGS_PREFERRED the file measured at `shape` (an older file has no static step, or no drafts
    replayed as graphs)."""
    measured = ((bench.get("shapes") or {}).get(shape) or {}).get("settings") or {}
    return next((s for s in SETTINGS_PREFERRED if s in measured), SETTINGS_PREFERRED[-1])


def step_cost(row: dict, family: str, tree: str, tokens: int) -> tuple[float | None, str]:
    """(cost of a step in plain steps, what it includes): the family's measured step on that tree, else the verify
    profile interpolated at `tokens` (drafting not included), else (None, "not measured")."""
    measured = ((row.get("drafting") or {}).get(family) or {}).get(tree)
    if measured and row.get("plain_step_ms"):
        return measured["step_ms"] / row["plain_step_ms"], "measured step"
    verify = row.get("verify")
    if verify and verify.get("sizes"):
        return float(np.interp(tokens, verify["sizes"], verify["relative"])), "verify only"
    return None, "not measured"


def projection_rows(bench: dict, shape: str = SHAPE, setting: str | None = None) -> list[dict]:
    """One row per PUBLISHED_STEPS entry: published accepted length and speedup, our step cost, their quotient."""
    setting = setting or chosen_setting(bench, shape)
    try:
        row = bench["shapes"][shape]["settings"][setting]
    except KeyError as e:
        raise ValueError(f"the bench file has no {shape!r} shape measured under {setting!r} (missing {e}); shapes: "
                         f"{sorted(bench.get('shapes', {}))}") from None
    rows = []
    for method, table, model, family, tree, tokens in PUBLISHED_STEPS:
        accepted = published_value(table, model, method, "accept_length")
        speedup = published_value(table, model, method, "speedup")
        cost, basis = step_cost(row, family, tree, tokens)
        rows.append({"method": method, "label": LABELS[method], "source": speedup.label if speedup else "-",
                     "accepted": accepted.value if accepted else None, "published_speedup": speedup and speedup.value,
                     "tree": tree, "tokens": tokens, "step_cost": cost, "basis": basis,
                     "projected_speedup": accepted.value / cost if accepted and cost else None})
    return rows


def _f(x, fmt: str) -> str:
    return "-" if x is None else fmt.format(x)


def projection_table(rows: list[dict]) -> str:
    lines = ["| Method | Published result | Accepted tokens a step (published) | Tree (tokens verified) | Step cost "
             "here (plain steps) | Cost measured as | Projected speedup | Published speedup |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tree = {"sparse64": "63-node", "chain15": "chain of 15"}.get(r["tree"], "dynamic")
        lines.append(f"| {r['label']} | {r['source']} | {_f(r['accepted'], '{:.2f}')} | {tree} ({r['tokens']}) | "
                     f"{_f(r['step_cost'], '{:.2f}')} | {r['basis']} | {_f(r['projected_speedup'], '{:.2f}x')} | "
                     f"{_f(r['published_speedup'], '{:.2f}x')} |")
    return "\n".join(lines) + "\n"


def _steps(host: dict) -> str:
    if host.get("static_drafts"):
        return ("the static step (CUDA graphs), each fixed tree's draft replayed as a CUDA graph (a tree grown per "
                "step drafts eagerly)")
    return "the static step (CUDA graphs)" if host.get("static_step") else "eager steps"


def projection_section(bench: dict, source: str, shape: str = SHAPE, setting: str | None = None) -> str:
    """The results document's section: what the figures are, from which file, the table, and what is missing."""
    setting = setting or chosen_setting(bench, shape)
    row = bench["shapes"][shape]["settings"][setting]
    host = row.get("host") or {}
    rows = projection_rows(bench, shape, setting)
    missing = [r["label"] for r in rows if r["accepted"] is None]
    verify_only = [r["label"] for r in rows if r["basis"] == "verify only"]
    out = [f"A projection from measured step costs and published acceptance, not a reproduction: no paper's weights "
           f"ran here. Projected speedup = the published accepted tokens a step / what a step of that method's tree "
           f"costs in this decoder, in plain (1-token) steps. Step costs from `{source}`: {bench.get('device')}, "
           f"{bench.get('date')}, {bench.get('dtype')}, random weights, this decoder at {bench.get('decoder_commit')}, "
           f"the {shape} shape, {host.get('threads')} host thread(s), cuDNN attention "
           f"{'on' if host.get('cudnn_attention') else 'off'}, "
           f"{_steps(host)}; a plain step "
           f"{row.get('plain_step_ms')} ms.",
           projection_table(rows).rstrip("\n")]
    if verify_only:
        out.append(f"{', '.join(verify_only)}: the file has no step of that family's drafter on that tree under these "
                   "settings, so the cost is the verify step alone (from the verify profile) and the projection an "
                   "upper bound: drafting, acceptance and bookkeeping are left out.")
    if missing:
        out.append(f"{', '.join(missing)}: no published accepted length in the sources docs/reference.md names, "
                   "so no projection.")
    if host.get("static_step"):
        out.append("EAGLE-3's drafter reads intermediate layers, which a replayed graph cannot hook, so its steps stay "
                   "eager under the static step (models/engine/static_step.py); its cost is that eager step's.")
    out.append("EAGLE-3's published row is LLaMA-3.1-8B's (the paper has no Vicuna-7B row); its cost is read at the "
               f"{shape} shape. The published speedups were measured on other machines and harnesses (the table "
               "names each); `make bench-gpu` on a GPU measures every family's step and replaces the verify-only costs.")
    return "\n\n".join(out) + "\n"


# EAGLE-3 paper, SGLang on an H100, LLaMA-3.1-8B, a chain of 3 drafts: throughput over the baseline by batch size
# (docs/reference.md, published numbers); EAGLE-1 falls below 1x from batch 24.
SGLANG_BATCH = {"eagle3": {2: 1.81, 8: 1.62, 16: 1.48, 64: 1.38}, "eagle": {2: 1.40}}


def batch_cost_section(bench: dict, shape: str = SHAPE) -> str | None:
    """The batched verify step against B (the bench file's host_settings row, batch_verify): a step of n tokens a
    sequence over a 1-token step at the same B, which is also the accepted tokens a step a method needs just to
    break even there (drafting left out), and for a chain of 3 (4 tokens) the most it could gain (4 tokens / that
    cost), beside the EAGLE-3 paper's SGLang speedups; None when the file has no batch figures."""
    row = ((((bench.get("shapes") or {}).get(shape) or {}).get("settings") or {}).get("host_settings") or {})
    bv = row.get("batch_verify")
    if not bv:
        return None
    sizes = bv["sizes"]
    cols = [n for n in (4, 16, 64) if n in sizes]
    lines = ["| batch size | " + " | ".join(f"{n} tokens a sequence (plain steps)" for n in cols) +
             " | a chain of 3 at best (4 / its cost) | EAGLE-3, SGLang (paper) | EAGLE-1, SGLang (paper) |",
             "|---|" + "---|" * (len(cols) + 3)]
    for B, rel in zip(bv["batch_sizes"], bv["relative"]):
        costs = {n: rel[sizes.index(n)] for n in cols}
        best = f"{4 / costs[4]:.2f}x" if 4 in costs else "-"
        pub = [f"{SGLANG_BATCH[m][B]:.2f}x" if B in SGLANG_BATCH[m] else "-" for m in ("eagle3", "eagle")]
        lines.append(f"| {B} | " + " | ".join(f"{costs[n]:.2f}" for n in cols) + f" | {best} | {' | '.join(pub)} |")
    return ("The batched verify step on that device (eager, as a batch decodes), from the same file: a step verifying "
            "n tokens for each of B sequences, in steps of the baseline at the same B. A method must accept more "
            "tokens a step than that to gain anything at B, drafting left out; a chain of 3 accepts at most 4.\n\n"
            + "\n".join(lines) + "\n")


def projection_markdown(path: str | Path, root: str | Path = ".") -> str | None:
    """The section for the bench file at `path` (relative to `root` unless absolute; named as given), or None when
    there is no such file."""
    full = Path(root) / path
    if not full.is_file():
        return None
    bench = json.loads(full.read_text())
    batch = batch_cost_section(bench)
    return projection_section(bench, str(path)) + ("\n" + batch if batch else "")
