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
library's converter maps them), the block's positions below the anchor drafted (sample_from_anchor false) and
speculators_config (greedy, block size - 1 tokens, the verifier by name or path).
"""
from __future__ import annotations

from pathlib import Path

import torch

from models.methods.dflash.dflash_format import dflash_config, to_file_key
from models.shared.draft_vocab import vocab_maps
from models.shared.formats import Format, write_files
from models.shared.speculators import SPECULATORS_VERSION, check_taps, verifier_of

WEIGHTS = "model.safetensors"
NOT_THE_LAYERS = ("architectures", "block_size", "dflash_config", "num_target_layers")   # the converter's drops


def speculators_dflash_state(heads) -> dict[str, torch.Tensor]:
    state = {to_file_key(k): v.detach() for k, v in heads.dflash.state_dict().items()}
    if heads.draft_ids is not None:
        dtype = state["fc.weight"].dtype
        state["lm_head.weight"] = heads.output_layer(0).weight.detach().to(dtype)
        state["d2t"], state["t2d"] = vocab_maps(heads.draft_ids, heads.config.vocab_size)
    return state


def speculators_dflash_config(heads, base_model, verifier: dict | None = None) -> dict:
    module = heads.dflash
    check_taps(tuple(module.taps), base_model.config.num_hidden_layers)
    layers = {k: v for k, v in dflash_config(module, base_model.config).items() if k not in NOT_THE_LAYERS}
    return {"architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": {**layers, "attn_implementation": "sdpa"},
            "draft_vocab_size": heads.config.out_size, "block_size": module.block_size,
            "target_hidden_size": None, "aux_hidden_state_layer_ids": list(module.taps),
            "mask_token_id": module.mask_token_id, "sliding_window_non_causal": False,
            "sample_from_anchor": False,
            "speculators_config": {
                "algorithm": "dflash",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": module.block_size - 1,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": verifier or verifier_of(base_model)},
            "dtype": "float32", "tie_word_embeddings": False}


def write_speculators_dflash(heads, base_model, folder: Path) -> tuple[list[str], list[str]]:
    state = speculators_dflash_state(heads)
    config = speculators_dflash_config(heads, base_model)
    notes = [f"verifier {config['speculators_config']['verifier']['name_or_path']!r}: vLLM and speculators load "
             "the base from it, and its input embedding (not written here)"]
    if heads.draft_ids is None:
        notes.append("no draft vocabulary: no lm_head, d2t or t2d; the library scores the verifier's LM head")
    return write_files(Path(folder), WEIGHTS, state, config), notes


SPECULATORS_DFLASH_FORMAT = Format("speculators", ("dflash",), write_speculators_dflash)
