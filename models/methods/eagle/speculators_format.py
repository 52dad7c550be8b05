"""EAGLE-3 heads as a checkpoint of the `speculators` library (0.9), the format vLLM detects from config.json.

    files, notes = write_speculators(heads, model, folder)     # config.json + model.safetensors, folder empty
    vllm serve <folder>                                        # vLLM reads the verifier from the config (not run here)

`model.safetensors` holds eagle3_format's tensors (models/methods/eagle/eagle3_format.py) with the layer under `layers.0.`
(the older file's `midlayer.`) and `embed_tokens.weight`, the base's input embedding, so the draft never depends on
where a loader finds the verifier's (the library's converter, given a file without one, drafted over zeros). `d2t`
and `t2d` only with a draft vocabulary (the library registers none without one). `config.json` is the
library's Eagle3SpeculatorConfig: architectures ["Eagle3Speculator"], speculators_model_type "eagle3", the one
layer as a nested Llama `transformer_layer_config`, `draft_vocab_size`, the taps (hidden-states indices, as vLLM
reads them), `norm_before_residual` written out (vLLM takes a missing one as true; ours is false: the residual is
the fused feature before hidden_norm) and `speculators_config` (greedy proposals as deep as the heads were
trained, the verifier by name or path and architectures). speculators has no layout for Medusa, Hydra or EAGLE-1.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from models.methods.eagle.eagle3_format import eagle3_config, eagle3_state
from models.shared.speculators import SPECULATORS_VERSION, check_taps, verifier_of

WEIGHTS, CONFIG = "model.safetensors", "config.json"
# transformers' own attention, which runs anywhere without torch.compile; the library's default, flex attention,
# falls back on a CPU to an unfused kernel with a warning (make interop: the same logits within 7.2e-7)
ATTN_IMPLEMENTATION = "sdpa"
# eagle3_format's file key prefix -> this format's
RENAMES = (("midlayer.", "layers.0."),)
# eagle3_format's config.json fields that are the draft's, not its layer's (the top level here has them), and
# torch_dtype, which transformers 5 names dtype
DRAFT_ONLY = ("architectures", "draft_vocab_size", "norm_before_residual", "eagle_aux_hidden_state_layer_ids",
              "eagle_config", "torch_dtype")


def speculators_state(heads, base_model) -> dict[str, torch.Tensor]:
    """eagle3_format's tensors renamed (midlayer. -> layers.0.) and the base's input embedding, in the file's
    dtype."""
    state = {}
    for key, value in eagle3_state(heads).items():
        for src, dst in RENAMES:
            if key.startswith(src):
                key = dst + key[len(src):]
        state[key] = value
    if heads.draft_ids is None:           # the full vocabulary: the library registers no d2t/t2d for it
        state.pop("d2t"), state.pop("t2d")
    embed = base_model.get_input_embeddings().weight.detach()
    state["embed_tokens.weight"] = embed.to(device="cpu", dtype=state["fc.weight"].dtype).contiguous()
    return state


def layer_config(heads, base_config, dtype: torch.dtype) -> dict:
    """transformer_layer_config: eagle3_format's one-layer Llama config of the base's sizes, its rotary settings
    as transformers 5 nests them (rope_parameters) and as 4.x reads them (rope_theta, rope_scaling), and
    transformers' sdpa attention."""
    config = {key: value for key, value in eagle3_config(heads, base_config, dtype).items()
              if key not in DRAFT_ONLY}
    rope = {"rope_theta": config["rope_theta"], **(config["rope_scaling"] or {"rope_type": "default"})}
    config.setdefault("head_dim", base_config.hidden_size // base_config.num_attention_heads)
    return {**config, "architectures": ["LlamaForCausalLM"], "rope_parameters": rope,
            "attn_implementation": ATTN_IMPLEMENTATION, "dtype": str(dtype).removeprefix("torch.")}


def speculators_config(heads, base_model, dtype: torch.dtype, verifier: dict | None = None) -> dict:
    """config.json: every field of speculators 0.9's Eagle3SpeculatorConfig, norm_before_residual explicit."""
    taps = tuple(heads.draft_module.taps)
    check_taps(taps, base_model.config.num_hidden_layers)
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": layer_config(heads, base_model.config, dtype),
            "draft_vocab_size": heads.config.out_size, "norm_before_residual": False,
            "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": list(taps), "norm_before_fc": False,
            "fc_norm": False, "norm_output": False, "embed_requires_grad": False,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": heads.config.num_heads,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": verifier or verifier_of(base_model)},
            "dtype": str(dtype).removeprefix("torch."), "tie_word_embeddings": False}


def write_speculators(heads, base_model, folder: Path, verifier: dict | None = None) -> tuple[list[str], list[str]]:
    """Write eagle3 `heads` (attached to `base_model`) to the empty or new `folder`; -> (files, notes).
    verifier: speculators_config.verifier ({"name_or_path", "architectures"}; default: the base's)."""
    folder = Path(folder)
    if folder.is_dir() and any(folder.iterdir()):
        raise FileExistsError(f"{folder} is not empty: export.format=speculators writes into a new or empty "
                              "folder and overwrites nothing")
    state = speculators_state(heads, base_model)
    config = speculators_config(heads, base_model, state["fc.weight"].dtype, verifier)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / WEIGHTS), metadata={"format": "pt"})
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    notes = [f"verifier {config['speculators_config']['verifier']['name_or_path']!r}: vLLM and speculators load "
             "the base from it", "embed_tokens.weight is the base's input embedding"]
    if heads.draft_ids is None:
        notes.append("no draft vocabulary: draft_vocab_size is the vocabulary's, and the file has no d2t or t2d")
    return [str(folder / WEIGHTS), str(folder / CONFIG)], notes
