"""A DFlash export run by the speculators library itself (PyPI speculators==0.9.0, unchanged), for `make dflash-check`
(pipelines/dflash_check.py). Runs ONLY in .venv-speculators (pipelines/interop.py builds it), never in the project's.

    .venv-speculators/bin/python conformance/speculators_dflash.py --draft D --inputs I.pt --out O.json

D: a folder written by export.format=speculators from DFlash heads, its verifier a folder with the base's weights;
I: {"hidden_states": [1, T, w] the base's taps, "input_ids": [1, T]}. It loads D with transformers' from_pretrained
on the class the library registers (its loading report) and with SpeculatorModel.from_pretrained (which fills the
embedding and LM head from the verifier), then runs the library's anchored-block forward
(DFlashDraftModel._backbone_forward) with max_anchors = T, so that its random choice takes every position that
leaves a whole block; the anchors and the logits of every block position go to O, with every file tensor compared
to the loaded model's. A `dspark` export (DSparkDraftModel) runs the library's whole training forward instead, its
loss replaced by a recorder of what it is handed: the block logits with the Markov bias of the true token before
each slot (sample_from_anchor as the file says) and the confidence head's logits, which go to O as well.
"""

import torch
from safetensors.torch import load_file
from speculators import SpeculatorModel
from speculators_draft import runner_main     # the EAGLE-3 runner's, beside this one: the report, the I/O


def dspark_forward(model, **inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The library's DSpark forward with compute_metrics recording its inputs -> (logits [1, N*bs, Vd], confidence
    logits [1, N*bs], anchored block indices [N*bs])."""
    import speculators.models.dspark.core as core

    seen, backbone, metrics = {}, model._backbone_forward, core.compute_metrics

    def kept(*args, **kwargs):
        out = backbone(*args, **kwargs)
        seen["indices"] = out[4]
        return out

    def recorded(logits, targets, confidence_logits, *args, **kwargs):
        seen["logits"], seen["confidence"] = logits, confidence_logits
        return logits.new_zeros(()), {}

    model._backbone_forward, core.compute_metrics = kept, recorded
    try:
        model(**inputs)
    finally:
        model._backbone_forward, core.compute_metrics = backbone, metrics
    return seen["logits"], seen["confidence"], seen["indices"]


def run(draft: str, inputs: dict) -> dict:
    model = SpeculatorModel.from_pretrained(draft).eval()
    hidden, ids = inputs["hidden_states"].float(), inputs["input_ids"]
    T, h, bs = ids.shape[1], model.config.transformer_layer_config.hidden_size, model.block_size
    given = dict(hidden_states=hidden, input_ids=ids, loss_mask=torch.ones(1, T),
                 verifier_last_hidden_states=torch.zeros(1, T, h), document_ids=torch.zeros(1, T, dtype=torch.long),
                 max_anchors=T)
    n = T - bs                                         # the positions it can draw (then 0s, marked invalid)
    extra = {}
    with torch.no_grad():
        if model.config.speculators_model_type == "dspark":
            logits, confidence, indices = dspark_forward(model, **given)
            extra["confidence"] = confidence[0].view(T, bs)[:n].tolist()
        else:
            out = model._backbone_forward(**given)
            logits, indices = out[1], out[4]
    logits, anchors = logits[0].view(T, bs, -1)[:n], indices.view(T, bs)[:n, 0]
    state, file = model.state_dict(), load_file(f"{draft}/model.safetensors")
    ignored = sorted(type(model)._keys_to_ignore_on_save)
    return {"anchors": anchors.tolist(), "logits": logits.tolist(), **extra,
            "model_class": type(model).__name__,
            "attn_implementation": model.config.transformer_layer_config._attn_implementation,
            "file_keys_not_in_model": sorted(set(file) - set(state)),
            "file_tensors_loaded_unchanged": all(torch.equal(state[k], v) for k, v in file.items() if k in state),
            "config": model.config.to_dict()}


def main():
    runner_main(__doc__.split("\n")[0], run, lambda path: torch.load(path, weights_only=True))


if __name__ == "__main__":
    main()
