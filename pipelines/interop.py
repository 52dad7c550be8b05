"""python -m pipelines.interop      (make interop)     [--seed 0 --topk 5 --model FOLDER]

An EAGLE-3 export read by its consumer's own code (docs/conformance.md#speculators-interop): a tiny EAGLE-3 draft
from a seed (models/methods/eagle/interop.py) on an 8-layer tiny Llama is written with export.format=speculators
(models/methods/eagle/speculators_format.py), and the speculators library, in its own environment (.venv-speculators,
built here on first use: torch 2.13.0, transformers 5.19.0, the library's import dependencies, speculators 0.9.0
without its dependencies; never a dependency of the project), loads it with SpeculatorModel.from_pretrained and
runs the draft (conformance/speculators_draft.py) on the same base hidden states and tokens as ours. It checks
that the library's loader finds no missing or unexpected key, that every tensor of the file is the loaded one,
and that its logits equal ours within 1e-5 with the same argmax at every row; then writes the library's top-k
at every row and the inputs to tests/golden/speculators_interop.json, which tests/test_speculators_format.py
replays against our draft without the library. Exits non-zero when a check fails.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from models.base import load_base_model
from models.methods import export_heads
from models.methods.eagle.interop import BASE, DEPTHS, DRAFT_VOCAB, draft_inputs, draft_logits, interop_base, \
    seeded_eagle3_heads
from pipelines.common import REPO_ROOT
from pipelines.conformance_harness import SPECULATORS_PACKAGES as PACKAGES
from pipelines.conformance_harness import SPECULATORS_VENV as VENV
from pipelines.conformance_harness import official_env

RUNNER = REPO_ROOT / "conformance" / "speculators_draft.py"
GOLDEN = REPO_ROOT / "tests" / "golden" / "speculators_interop.json"
TOLERANCE = 1e-5


def library_run(work: Path, folder: Path, inputs: dict) -> dict:
    """The library's loading report and logits for the export in `folder` on `inputs`."""
    request, out = work / "inputs.json", work / "result.json"
    request.write_text(json.dumps({"hidden_states": inputs["hidden_states"].tolist(),
                                   "input_ids": inputs["next_tokens"].tolist(),
                                   "position_ids": inputs["position_ids"].tolist()}))
    subprocess.run([str(official_env(VENV, PACKAGES)), str(RUNNER), "--draft", str(folder), "--inputs",
                    str(request), "--out", str(out)], check=True)
    return json.loads(out.read_text())


def checks(result: dict, ours: torch.Tensor) -> dict:
    """Each check's verdict, and the largest logit difference."""
    theirs = torch.tensor(result["logits"])
    report = result["loading_report"]
    return {"missing_keys": report["missing_keys"], "unexpected_keys": report["unexpected_keys"],
            "mismatched_keys": report["mismatched_keys"], "keys_not_in_file": result["keys_not_in_file"],
            "file_keys_not_in_model": result["file_keys_not_in_model"], "nan_parameters": result["nan_parameters"],
            "file_tensors_loaded_unchanged": result["file_tensors_loaded_unchanged"],
            "max_abs_logit_difference": float((theirs - ours).abs().max()),
            "same_argmax_rows": int((theirs.argmax(-1) == ours.argmax(-1)).sum()), "rows": ours.shape[0]}


def passed(verdict: dict) -> bool:
    empty = ("missing_keys", "unexpected_keys", "mismatched_keys", "keys_not_in_file", "file_keys_not_in_model",
             "nan_parameters")
    return (all(not verdict[k] for k in empty) and verdict["file_tensors_loaded_unchanged"]
            and verdict["max_abs_logit_difference"] <= TOLERANCE and verdict["same_argmax_rows"] == verdict["rows"])


def write_golden(result: dict, inputs: dict, heads, seed: int, topk: int, path: Path = GOLDEN) -> None:
    theirs = torch.tensor(result["logits"])
    top = theirs.topk(topk, dim=-1)
    golden = {"about": "the speculators library's EAGLE-3 draft logits (depth 0, top-k over the draft vocabulary at "
                       "every row) for a seeded tiny draft exported with export.format=speculators; written by "
                       "`make interop`",
              "versions": result["versions"], "base": BASE, "seed": seed, "draft_vocab_size": DRAFT_VOCAB,
              "depths": DEPTHS, "draft_ids": heads.draft_ids.tolist(), "tokens": inputs["input_ids"],
              "position_ids": inputs["position_ids"].tolist(), "hidden_states": inputs["hidden_states"].tolist(),
              "topk_ids": top.indices.tolist(), "topk_values": top.values.tolist()}
    path.write_text(json.dumps(golden, separators=(",", ":")) + "\n")
    print(f"wrote {path.relative_to(REPO_ROOT)}", flush=True)


def run_case(name: str, model, work: Path, seed: int) -> tuple[dict, dict, dict, object]:
    """Export the seeded draft on `model` (whose name_or_path is a folder with its weights: the verifier), run it
    through the library -> (verdict, the library's result, the inputs, the heads)."""
    heads = seeded_eagle3_heads(model, seed)
    export_heads(heads, model, work / name, "speculators")
    inputs = draft_inputs(model, heads, seed)
    result = library_run(work, work / name, inputs)
    verdict = checks(result, draft_logits(heads, inputs))
    print(f"{name}: speculators {result['versions']['speculators']} loaded {work / name} as {result['model_class']} "
          f"(attention {result['attn_implementation']}): {json.dumps(verdict)}", flush=True)
    ours = set(json.loads((work / name / "config.json").read_text()))
    print(f"{name}: config fields the library writes that the export leaves to defaults: "
          f"{sorted(set(result['config']) - ours)}", flush=True)
    return verdict, result, inputs, heads


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[2])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--topk", type=int, default=5)
    ap.add_argument("--model", default=None, help="also a base model folder (e.g. artifacts/models/SmolLM2-135M-"
                    "Instruct): the same seeded draft on it, checked but not written to the golden file")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="interop-speculators-"))
    model, _ = interop_base()
    model.save_pretrained(work / "base")                 # the verifier the library loads the base's parts from
    model.config.name_or_path = str(work / "base")
    verdict, result, inputs, heads = run_case("tiny", model, work, args.seed)
    verdicts = {"tiny": verdict}
    if args.model:
        verdicts["model"] = run_case("model", load_base_model(str(Path(args.model).resolve()))[0], work,
                                     args.seed)[0]
    if not all(passed(v) for v in verdicts.values()):
        print("INTEROP FAILED: the golden file is not written", flush=True)
        sys.exit(1)
    write_golden(result, inputs, heads, args.seed, args.topk)
    return verdicts


if __name__ == "__main__":
    main()
