"""DFlash heads as a checkpoint of the `speculators` library (0.9): its registered `dflash` type
(DFlashSpeculatorConfig, DFlashDraftModel), the format vLLM detects from config.json.

    files, notes = write_speculators_dflash(heads, model, folder)    # config.json + model.safetensors

`model.safetensors` holds dflash_format's tensors: the library's DFlashDraftModel names its parts as the authors do
(fc, hidden_norm, norm, layers.{i}.self_attn.{q,k,v,o}_proj and {q,k}_norm, mlp.*, the two layer norms). With a
draft vocabulary it also holds lm_head.weight (the base LM head's rows of the draft ids, what the heads score) and
d2t, t2d (eagle3_format's maps, the library's convention); without one neither: the library omits a full-vocabulary
lm_head on save and reloads the verifier's, as it does embed_tokens. `config.json` is DFlashSpeculatorConfig:
architectures ["DFlashSpeculator"], speculators_model_type "dflash", dflash_format's Qwen3 config of the draft's
sizes as transformer_layer_config (less the keys the library's own converter drops), draft_vocab_size, block_size,
mask_token_id, aux_hidden_state_layer_ids = the taps (hidden-states indices: the authors' layer id + 1, as the
library's converter maps them), sample_from_anchor as trained (heads.sample_from_anchor: false, slot k drafts the
token k after the anchor; true, the token k + 1 after it) and speculators_config (greedy, the block's drafting slots
as its tokens: block size - 1, or block size with sample_from_anchor; the verifier by name or path). The mask must
be a token of the base (check_base_mask): the library embeds it with the verifier's table.

DSpark heads go to the library's `dspark` type (DSparkSpeculatorConfig, DSparkDraftModel): the same, plus the Markov
head (markov_head.markov_w1, markov_w2, and gate_proj or joint_proj for the gated and rnn kinds) and the confidence
head (confidence_head.proj), with markov_rank, markov_head_type, the confidence head on and fed the Markov
embedding, and sample_from_anchor as trained (false: slot k scores the token k after the anchor, slot 0's bias
is the anchor's own token's; true, the library's DSpark default: slot k scores the token k + 1 after it, its bias the
token at k).
"""
from __future__ import annotations

from pathlib import Path

import torch

from models.methods.dflash.dflash_format import check_base_mask, dflash_config, to_file_key
from models.shared.draft_vocab import vocab_maps
from models.shared.formats import Format, write_files
from models.shared.speculators import SPECULATORS_VERSION, check_taps, verifier_of

WEIGHTS = "model.safetensors"
NOT_THE_LAYERS = ("architectures", "block_size", "dflash_config", "num_target_layers")   # the converter's drops


# DSpark's parts: our module names -> the library's (speculators/models/dspark/model_definitions.py)
DSPARK_KEYS = {"markov.w1.": "markov_head.markov_w1.", "markov.w2.": "markov_head.markov_w2.",
               "markov.gate.": "markov_head.gate_proj.", "markov.cell.": "markov_head.joint_proj.",
               "confidence.proj.": "confidence_head.proj."}


def is_dspark(heads) -> bool:
    return getattr(heads, "markov", None) is not None


def dspark_state(heads) -> dict[str, torch.Tensor]:
    parts = {f"markov.{k}": v for k, v in heads.markov.state_dict().items()}
    parts.update({f"confidence.{k}": v for k, v in heads.confidence.state_dict().items()})
    out = {}
    for key, value in parts.items():
        ours = next(p for p in DSPARK_KEYS if key.startswith(p))
        out[DSPARK_KEYS[ours] + key[len(ours):]] = value.detach()
    return out


def speculators_dflash_state(heads) -> dict[str, torch.Tensor]:
    state = {to_file_key(k): v.detach() for k, v in heads.dflash.state_dict().items()}
    if is_dspark(heads):
        state.update(dspark_state(heads))
    if heads.draft_ids is not None:
        dtype = state["fc.weight"].dtype
        state["lm_head.weight"] = heads.output_layer(0).weight.detach().to(dtype)
        state["d2t"], state["t2d"] = vocab_maps(heads.draft_ids, heads.config.vocab_size)
    return state


def speculators_dflash_config(heads, base_model, verifier: dict | None = None) -> dict:
    module = heads.dflash
    check_taps(tuple(module.taps), base_model.config.num_hidden_layers)
    layers = {k: v for k, v in dflash_config(module, base_model.config).items() if k not in NOT_THE_LAYERS}
    kind = "dspark" if is_dspark(heads) else "dflash"
    own = {} if kind == "dflash" else {
        "markov_rank": heads.markov.rank, "markov_head_type": heads.markov.kind, "enable_confidence_head": True,
        "confidence_head_with_markov": True}
    return {"architectures": ["DSparkSpeculator" if kind == "dspark" else "DFlashSpeculator"],
            "speculators_model_type": kind, **own,
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": {**layers, "attn_implementation": "sdpa"},
            "draft_vocab_size": heads.config.out_size, "block_size": module.block_size,
            "target_hidden_size": None, "aux_hidden_state_layer_ids": list(module.taps),
            "mask_token_id": module.mask_token_id, "sliding_window_non_causal": False,
            "sample_from_anchor": module.sample_from_anchor,
            "speculators_config": {
                "algorithm": kind,
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": module.depths,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": verifier or verifier_of(base_model)},
            "dtype": "float32", "tie_word_embeddings": False}


def write_speculators_dflash(heads, base_model, folder: Path) -> tuple[list[str], list[str]]:
    check_base_mask(heads.dflash, "speculators")
    state = speculators_dflash_state(heads)
    config = speculators_dflash_config(heads, base_model)
    notes = [f"verifier {config['speculators_config']['verifier']['name_or_path']!r}: vLLM and speculators load "
             "the base from it, and its input embedding (not written here)"]
    if heads.draft_ids is None:
        notes.append("no draft vocabulary: no lm_head, d2t or t2d; the library scores the verifier's LM head")
    return write_files(Path(folder), WEIGHTS, state, config), notes


SPECULATORS_DFLASH_FORMAT = Format("speculators", ("dflash",), write_speculators_dflash)
SPECULATORS_DSPARK_FORMAT = Format("speculators", ("dspark", "dspark_gated", "dspark_rnn"), write_speculators_dflash)
