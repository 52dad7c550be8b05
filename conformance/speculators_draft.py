"""An EAGLE-3 export run by the speculators library itself (PyPI speculators==0.9.0, unchanged), for `make interop`
(pipelines/interop.py). Runs ONLY in .venv-speculators (torch 2.13.0, transformers 5.19, speculators 0.9.0),
never in the project's.

    .venv-speculators/bin/python conformance/speculators_draft.py --draft D --inputs I.json --out O.json

D: a folder written by export.format=speculators; I: {"hidden_states": [[3h floats] per row], "input_ids": [the
token after each row], "position_ids": [...]}. It loads D twice: with transformers' from_pretrained on the class
the library registers for the config (its loading report: missing and unexpected keys) and with the library's own
SpeculatorModel.from_pretrained, whose draft runs one step (ttt_steps=1) over the rows; the logits its lm_head
gives ([rows, draft vocabulary]) go to O with the report, the config as the library reads it back and every file
tensor compared to the loaded model's.
"""
import argparse
import json
from importlib.metadata import version

import torch
from safetensors.torch import load_file
from speculators import SpeculatorModel, SpeculatorModelConfig
from transformers import PreTrainedModel


def loading_report(draft: str) -> dict:
    """transformers' own account of the file against the registered class (the library's wrapper drops it)."""
    config = SpeculatorModelConfig.from_pretrained(draft)
    cls = SpeculatorModel.registered_model_class_from_config(config)
    _, info = PreTrainedModel.from_pretrained.__func__(cls, draft, config=config, output_loading_info=True)
    return {"class": cls.__name__, **{k: sorted(v) for k, v in info.items() if k in (
        "missing_keys", "unexpected_keys", "mismatched_keys")}}


def run(draft: str, inputs: dict) -> dict:
    model = SpeculatorModel.from_pretrained(draft).eval()
    captured = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()))
    rows = len(inputs["input_ids"])
    with torch.no_grad():
        model(hidden_states=torch.tensor(inputs["hidden_states"], dtype=torch.float32)[None],
              input_ids=torch.tensor(inputs["input_ids"])[None], document_ids=torch.zeros(1, rows, dtype=torch.long),
              position_ids=torch.tensor(inputs["position_ids"])[None], ttt_steps=1)
    state, file = model.state_dict(), load_file(f"{draft}/model.safetensors")
    ignored = sorted(type(model)._keys_to_ignore_on_save)      # the verifier's LM head and norm, never in a file
    return {"logits": captured[0][0].tolist(), "model_class": type(model).__name__,
            "attn_implementation": model.config.transformer_layer_config._attn_implementation,
            "keys_not_in_file": sorted(set(state) - set(file) - set(ignored)), "ignored_on_save": ignored,
            "file_keys_not_in_model": sorted(set(file) - set(state)),
            "file_tensors_loaded_unchanged": all(torch.equal(state[k], v) for k, v in file.items() if k in state),
            "nan_parameters": sorted(k for k, v in state.items() if v.is_floating_point() and bool(v.isnan().any())
                                     and k not in ignored),
            "config": model.config.to_dict()}


def runner_main(description: str, run, read_inputs) -> None:
    """What the speculators runners share (this one and speculators_dflash.py): --draft, --inputs, --out; the library
    versions, transformers' loading report and run(draft, inputs) written to --out."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result = {"versions": {p: version(p) for p in ("speculators", "transformers", "torch")},
              "loading_report": loading_report(args.draft), **run(args.draft, read_inputs(args.inputs))}
    with open(args.out, "w") as f:
        json.dump(result, f, default=str)


def main():
    runner_main(__doc__.split("\n")[0], run, lambda path: json.loads(open(path).read()))


if __name__ == "__main__":
    main()
