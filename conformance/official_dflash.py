"""Run in the authors' environment (.venv-dflash: torch 2.13.0, transformers 5.15.0, dflash 0.1.0 without its
dependencies; pipelines/dflash_export_check.py builds it): load our export with the authors' DFlashDraftModel and run
their forward on the inputs our module was run on, then print, as one JSON line, how far their block outputs are
from ours.

    python conformance/official_dflash.py --draft FOLDER --inputs inputs.pt
inputs.pt: target_hidden [1, C, w], noise_embedding [1, Q, h], position_ids [1, C + Q], ours [1, Q, h].
"""
import argparse
import json

import torch
from dflash.model import DFlashDraftModel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", required=True)
    ap.add_argument("--inputs", required=True)
    args = ap.parse_args()
    x = torch.load(args.inputs, weights_only=True)
    model = DFlashDraftModel.from_pretrained(args.draft, dtype=torch.float32).eval()
    with torch.inference_mode():
        theirs = model(target_hidden=x["target_hidden"], noise_embedding=x["noise_embedding"],
                       position_ids=x["position_ids"])
    diff = (theirs - x["ours"]).abs()
    print(json.dumps({"max_abs_diff": float(diff.max()), "max_abs": float(x["ours"].abs().max()),
                      "target_layer_ids": list(model.target_layer_ids), "block_size": model.block_size,
                      "mask_token_id": model.mask_token_id}))


if __name__ == "__main__":
    main()
