"""python -m pipelines.dflash_check     (make dflash-check)     [--seed 0 --layers 2 --block 16]

DFlash's export read by the authors' own code: a seeded DFlash drafter on an 8-layer tiny Llama is written with
export.format=dflash (models/methods/dflash/dflash_format.py), and the authors' package, in its own environment
(.venv-dflash, built here on first use: torch 2.13.0, transformers 5.15.0, dflash 0.1.0 without its dependencies;
never a dependency of the project), loads it with DFlashDraftModel.from_pretrained and runs its forward
(conformance/official_dflash.py) on the same context features, block and positions as ours. Passes when their block
outputs equal ours within 1e-5 and the layer ids, block size and mask token are ours; writes
reports/dflash_check.json and exits non-zero otherwise.
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
from models.methods import build_heads, export_heads
from models.shared import HeadsConfig
from pipelines.common import REPO_ROOT, write_json
from pipelines.conformance_harness import official_env

VENV = REPO_ROOT / ".venv-dflash"
PACKAGES = (["torch==2.13.0"], ["transformers==5.15.0", "safetensors"], ["--no-deps", "dflash==0.1.0"])
RUNNER = REPO_ROOT / "conformance" / "official_dflash.py"
REPORT = REPO_ROOT / "reports" / "dflash_check.json"
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
    verdict = {**theirs, "ours": {"target_layer_ids": module.target_layer_ids, "block_size": module.block_size,
                                  "mask_token_id": module.mask_token_id},
               "tolerance": TOLERANCE, "settings": vars(args), "packages": [a for s in PACKAGES for a in s]}
    verdict["passed"] = (theirs["max_abs_diff"] <= TOLERANCE and theirs["target_layer_ids"] == module.target_layer_ids
                         and theirs["block_size"] == module.block_size
                         and theirs["mask_token_id"] == module.mask_token_id)
    write_json(REPORT, verdict)
    print(json.dumps(verdict, indent=2))
    return verdict


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
