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
each slot (sample_from_anchor as the file says) and the confidence head's logits, which go to O as well; and the
library's own loss (its compute_metrics with its eager KL and TV terms, the fused ones needing Triton) on them, with
its verifier targets (I's "verifier_last_hidden_states": the base's last states before its final norm) and with
one-hot targets of the tokens each slot drafts (the distilled-token loss every method here trains on).
"""

import torch
from safetensors.torch import load_file
from speculators import SpeculatorModel
from speculators_draft import runner_main     # the EAGLE-3 runner's, beside this one: the report, the I/O


GAMMA, ALPHA = 4.0, 1.0          # the library's defaults (dflash_decay_gamma, confidence_head_alpha), stated


def dspark_forward(model, **inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """The library's DSpark forward with compute_metrics recording its inputs -> (logits [1, N*bs, Vd], confidence
    logits [1, N*bs], anchored block indices [N*bs], the library's loss with its eager terms on them: "teacher" its
    verifier targets, "one_hot" the tokens each slot drafts; "total" and its "confidence" term)."""
    import speculators.models.dspark.core as core
    from speculators.losses import eager

    seen, backbone, metrics = {}, model._backbone_forward, core.compute_metrics

    def kept(*args, **kwargs):
        out = backbone(*args, **kwargs)
        seen["indices"] = out[4]
        return out

    def recorded(logits, targets, confidence_logits, *args, **kwargs):
        seen["logits"], seen["confidence"] = logits, confidence_logits
        kwargs.update(loss_config={"kl_div": (eager.kl_div_loss, 1.0)}, tv_loss_fn=eager.tv_loss)
        ids, T = inputs["input_ids"][0], inputs["input_ids"].shape[1]
        drafted = ids[(seen["indices"] + int(model.config.sample_from_anchor)).clamp(max=T - 1)]   # each slot's token
        one_hot = torch.full_like(logits, float("-inf")).index_put_(
            (torch.zeros_like(drafted), torch.arange(drafted.numel()), drafted), torch.tensor(0.0))
        seen["loss"] = {}
        for name, target in (("teacher", targets), ("one_hot", one_hot)):
            loss, m = metrics(logits, target, confidence_logits, *args, **kwargs)
            seen["loss"][name] = {"total": float(loss), "confidence": float(m["confidence_loss_sum"])}
        return logits.new_zeros(()), {}

    model._backbone_forward, core.compute_metrics = kept, recorded
    try:
        model(**inputs, gamma=GAMMA, confidence_head_alpha=ALPHA)
    finally:
        model._backbone_forward, core.compute_metrics = backbone, metrics
    return seen["logits"], seen["confidence"], seen["indices"], seen["loss"]


def run(draft: str, inputs: dict) -> dict:
    model = SpeculatorModel.from_pretrained(draft).eval()
    hidden, ids = inputs["hidden_states"].float(), inputs["input_ids"]
    T, h, bs = ids.shape[1], model.config.transformer_layer_config.hidden_size, model.block_size
    verifier = inputs.get("verifier_last_hidden_states", torch.zeros(1, T, h)).float()
    given = dict(hidden_states=hidden, input_ids=ids, loss_mask=torch.ones(1, T),
                 verifier_last_hidden_states=verifier, document_ids=torch.zeros(1, T, dtype=torch.long),
                 max_anchors=T)
    n = T - bs                                         # the positions it can draw (then 0s, marked invalid)
    extra = {}
    with torch.no_grad():
        if model.config.speculators_model_type == "dspark":
            logits, confidence, indices, loss = dspark_forward(model, **given)
            extra.update(confidence=confidence[0].view(T, bs)[:n].tolist(), loss=loss, gamma=GAMMA,
                         confidence_alpha=ALPHA, sample_from_anchor=bool(model.config.sample_from_anchor))
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
