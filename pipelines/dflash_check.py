"""python -m pipelines.dflash_check     (make dflash-check)     [--seed 0 --layers 2 --block 16]

DFlash's export read by the authors' own code: a seeded DFlash drafter on an 8-layer tiny Llama is written with
export.format=dflash (models/methods/dflash/dflash_format.py), and the authors' package, in its own environment
(.venv-dflash, built here on first use: torch 2.13.0, transformers 5.15.0, dflash 0.1.0 without its dependencies;
never a dependency of the project), loads it with DFlashDraftModel.from_pretrained and runs its forward
(conformance/official_dflash.py) on the same context features, block and positions as ours; then the authors'
dflash_generate decodes a few prompts greedily on the same base and drafter, and our decoder decodes them with the
drafter on a chain of block - 1 drafts. Passes when their block outputs equal ours within 1e-5, the layer ids, block
size and mask token are ours, and every step drafts the same block and produces the same tokens; writes
reports/dflash_check.json and the authors' steps to tests/golden/dflash_conformance.json (which tests/test_dflash.py
replays without the package), and exits non-zero when a check fails.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from models.base import build_tiny_model
from models.engine.decoding import generate
from models.engine.drafting import heads_drafter
from models.engine.trees import chain_tree
from models.methods import build_heads, export_heads
from models.shared import HeadsConfig
from pipelines.common import REPO_ROOT, write_json
from pipelines.conformance_harness import official_env

VENV = REPO_ROOT / ".venv-dflash"
PACKAGES = (["torch==2.13.0"], ["transformers==5.15.0", "safetensors"], ["--no-deps", "dflash==0.1.0"])
RUNNER = REPO_ROOT / "conformance" / "official_dflash.py"
REPORT = REPO_ROOT / "reports" / "dflash_check.json"
GOLDEN = REPO_ROOT / "tests" / "golden" / "dflash_conformance.json"
PROMPTS = 3                 # random prompts of 12 tokens
NEW_TOKENS = 40
TOLERANCE = 1e-5


def seeded(seed: int, layers: int, block: int):
    """(base, heads): the tiny base and a DFlash drafter whose every parameter is drawn from torch.Generator(seed)."""
    model, _ = build_tiny_model("llama", num_layers=8, seed=0)
    config = HeadsConfig.for_base(model, "dflash", num_heads=block - 1, num_layers=layers, share_lm_head=True)
    heads = build_heads(config, model).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(heads.dflash.named_parameters()):
            draw = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * draw if p.dim() == 1 else draw / p.shape[-1] ** 0.5)
    return model, heads


def our_steps(model, heads, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """Our decoder on each prompt with the drafter on a chain of block - 1 drafts: every step's drafts and produced
    tokens, and the output, in the layout of the authors' side (conformance/official_dflash.py)."""
    out = []
    for ids in prompts:
        drafter, drafts = heads_drafter(heads, chain_tree(heads.dflash.block_size - 1)), []
        draft = drafter.draft
        drafter.draft = lambda root, depth: drafts.append(draft(root, depth)) or drafts[-1]
        res = generate(model, None, ids, drafter, max_new_tokens=new_tokens, stop_token_ids=[])
        steps = [{"drafts": d.tokens[1:].tolist(), "produced": n} for d, n in zip(drafts, res.accept_lengths)]
        out.append({"output_tokens": res.new_tokens, "steps": steps})
    return out


def same_step(x: dict, y: dict, full: int) -> bool:
    """The same tokens produced, and the same drafts where both drafted a whole block of `full` drafts. Near the
    length limit the blocks differ in length (our decoder drafts as many as can be emitted, the authors' one more),
    and a block's length changes every position's draft (the block attends to itself both ways): those steps are
    compared by what they produce."""
    same_drafts = x["drafts"] == y["drafts"] if len(x["drafts"]) == len(y["drafts"]) == full else True
    return x["produced"] == y["produced"] and same_drafts


def compare(ours: list[dict], theirs: list[dict], full: int) -> dict:
    """Steps compared, and the first that differs (its drafts or the tokens it produced) or an output that does."""
    compared, first = 0, None
    for q, (a, b) in enumerate(zip(ours, theirs)):
        if a["output_tokens"] != b["output_tokens"] and first is None:
            first = {"prompt": q, "output": True}
        for s, (x, y) in enumerate(zip(a["steps"], b["steps"])):
            compared += 1
            if not same_step(x, y, full) and first is None:
                first = {"prompt": q, "step": s, "ours": x, "theirs": y}
    blocks = sum(len(s["drafts"]) == full for p in theirs for s in p["steps"])
    return {"steps_compared": compared, "whole_blocks_compared": blocks, "identical": first is None,
            "first_mismatch": first,
            "steps_accepting_drafts": sum(s["produced"] > 1 for p in theirs for s in p["steps"])}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[2])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block", type=int, default=16)
    args = ap.parse_args(argv)
    model, heads = seeded(args.seed, args.layers, args.block)
    module = heads.dflash
    g = torch.Generator().manual_seed(args.seed + 1)
    C, Q = 12, args.block
    features = torch.randn(1, C, module.fc.in_features, generator=g)
    block = torch.full((1, Q), module.mask_token_id)
    block[0, 0] = 7
    pos = torch.arange(C + Q)[None]
    with torch.no_grad():
        ours = module(features, block, pos)
    work = Path(tempfile.mkdtemp(prefix="dflash-check-"))
    export_heads(heads, model, work / "draft", "dflash")
    torch.save({"target_hidden": features, "noise_embedding": module.embed(block), "position_ids": pos,
                "ours": ours}, work / "inputs.pt")
    out = subprocess.run([str(official_env(VENV, PACKAGES)), str(RUNNER), "--draft", str(work / "draft"),
                          "--inputs", str(work / "inputs.pt")], check=True, capture_output=True, text=True)
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    prompts = torch.randint(model.config.vocab_size - 1, (PROMPTS, 12), generator=g).tolist()
    model.save_pretrained(work / "target")
    (work / "prompts.json").write_text(json.dumps(prompts))
    run = subprocess.run([str(official_env(VENV, PACKAGES)), str(RUNNER), "--draft", str(work / "draft"), "--target",
                          str(work / "target"), "--prompts", str(work / "prompts.json"), "--new-tokens",
                          str(NEW_TOKENS)], check=True, capture_output=True, text=True)
    official = json.loads(run.stdout.strip().splitlines()[-1])["prompts"]
    torch.set_num_threads(1)
    steps = compare(our_steps(model, heads, prompts, NEW_TOKENS), official, module.block_size - 1)
    verdict = {**theirs, "steps": steps, "ours": {"target_layer_ids": module.target_layer_ids, "block_size": module.block_size,
                                  "mask_token_id": module.mask_token_id},
               "tolerance": TOLERANCE, "settings": vars(args), "packages": [a for s in PACKAGES for a in s]}
    verdict["passed"] = (theirs["max_abs_diff"] <= TOLERANCE and theirs["target_layer_ids"] == module.target_layer_ids
                         and theirs["block_size"] == module.block_size
                         and theirs["mask_token_id"] == module.mask_token_id and steps["identical"])
    write_json(REPORT, verdict)
    if verdict["passed"]:
        write_json(GOLDEN, {"about": "the authors' dflash_generate (dflash 0.1.0, greedy) on a seeded DFlash drafter "
                                     "and an 8-layer tiny Llama: each step's drafted block and produced tokens; "
                                     "written by `make dflash-check`",
                            **vars(args), "new_tokens": NEW_TOKENS, "prompts": prompts, "official": official})
    print(json.dumps(verdict, indent=2))
    return verdict


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
