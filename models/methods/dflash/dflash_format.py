"""DFlash heads in the authors' format: a folder `DFlashDraftModel.from_pretrained` (dflash 0.1.0) loads.

    files, notes = write_dflash(heads, model, folder)     # config.json + model.safetensors

`config.json` is a Qwen3 config of the draft's sizes (`num_hidden_layers`: the draft layers; `num_target_layers`:
the base's) with `dflash_config` {target_layer_ids, block_size, mask_token_id}; `model.safetensors` holds fc,
hidden_norm, norm and per layer `layers.{i}.self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`,
`mlp.{gate,up,down}_proj`, `input_layernorm` and `post_attention_layernorm`. The authors' drafter scores the
target's LM head over the full vocabulary: a draft vocabulary is not carried (see the notes).
"""
from __future__ import annotations

from pathlib import Path

from models.shared.formats import Format, write_files

WEIGHTS = "model.safetensors"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


def to_file_key(key: str) -> str:
    """Our module's state-dict name -> the authors' (attention parts under self_attn)."""
    parts = key.split(".")
    if parts[0] == "layers" and parts[2] in ATTENTION:
        return ".".join([*parts[:2], "self_attn", *parts[2:]])
    return key


def check_base_mask(module, fmt: str) -> None:
    """The format embeds the mask with the base's table (mask_token_id a row of it): a drafter whose mask is its own
    token (heads.mask_token_id null: id vocab_size, a learned embedding) has no such row, so it is refused."""
    if module.own_mask:
        raise ValueError(f"export.format={fmt} embeds the mask token with the base's embedding table, but this "
                         f"drafter's mask is its own token (heads.mask_token_id=null: id {module.vocab_size}, a "
                         f"learned embedding); train it with heads.mask_token_id set to an id of the base's "
                         f"vocabulary, 0 to {module.vocab_size - 1}, to export it")


def dflash_config(module, base_config) -> dict:
    layer = module.layers[0]
    rope = dict(getattr(base_config, "rope_parameters", None) or {})
    theta = float(rope.get("rope_theta", getattr(base_config, "rope_theta", 10000.0)))
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": base_config.hidden_size, "intermediate_size": layer.mlp.gate_proj.out_features,
            "num_attention_heads": layer.heads, "num_key_value_heads": layer.kv_heads, "head_dim": layer.head_dim,
            "num_hidden_layers": len(module.layers), "num_target_layers": base_config.num_hidden_layers,
            "rms_norm_eps": float(module.norm.variance_epsilon), "rope_theta": theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta},
            "vocab_size": base_config.vocab_size, "max_position_embeddings": base_config.max_position_embeddings,
            "attention_bias": False, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
            "block_size": module.block_size, "mask_token_id": module.mask_token_id,
            "dflash_config": {"target_layer_ids": list(module.target_layer_ids), "block_size": module.block_size,
                              "mask_token_id": module.mask_token_id}}


def write_dflash(heads, base_model, folder: Path) -> tuple[list[str], list[str]]:
    module = heads.dflash
    check_base_mask(module, "dflash")
    if module.sample_from_anchor:
        raise ValueError("export.format=dflash: the authors' DFlash format has no sample_from_anchor (its slot k "
                         "drafts the token k after the anchor); these heads were trained with "
                         "heads.sample_from_anchor=true; export them with export.format=speculators, which carries it")
    rope = dict(getattr(base_model.config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"the authors' DFlash layer is a Qwen3 layer with the default rotary embedding; this base "
                         f"scales it ({rope.get('rope_type')!r}), which the format has no field for")
    state = {to_file_key(k): v for k, v in module.state_dict().items()}
    notes = []
    if heads.draft_ids is not None:
        notes.append(f"the draft scores {len(heads.draft_ids)} tokens here; the authors' drafter scores the target's "
                     "LM head over the full vocabulary, so its drafts may differ where the best token lies outside "
                     "this draft vocabulary")
    return write_files(folder, WEIGHTS, state, dflash_config(module, base_model.config)), notes


DFLASH_FORMAT = Format("dflash", ("dflash",), write_dflash)
