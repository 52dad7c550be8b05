"""Hydra and Hydra++ heads in the authors' Hydra format (hydra_lm_head.pt + config.json, arch mlp or prefix-mlp),
listed by Hydra's and Hydra++'s Methods as `hydra` (models/shared/formats.py); the layout is described there.
"""
from __future__ import annotations

from pathlib import Path

import torch

from models.shared import DraftHeads, HeadsConfig
from models.shared.formats import (OUTSIDE_DRAFT_VOCAB, Format, full_lm_head, load_state, read_files,
                                  write_files)


def _hydra_state(heads: DraftHeads, base, notes: list[str]) -> tuple[dict[str, torch.Tensor], dict]:
    cfg = heads.config
    if cfg.num_layers > 2 and not cfg.shared_blocks:
        raise ValueError(f"num_layers={cfg.num_layers} with shared_blocks=false: the official Hydra code builds "
                         "blocks 1..L-1 of a head as one module repeated ([ResBlock] * (L-1)), so heads with more "
                         "than 2 distinct blocks cannot load there (train them with shared_blocks: true)")
    prefix = heads.family.prefix_layer
    step = 2 if prefix else 1      # prefix-mlp puts a Dropout before every block and before the LM head
    state = {}
    for k in range(cfg.num_heads):
        first, rest = heads.blocks[k][0], list(heads.blocks[k])[1:]
        at = f"hydra_mlp.{k}.{step - 1}"
        state[f"{at}.linear.weight"], state[f"{at}.linear.bias"] = first.linear.weight.detach(), first.linear.bias.detach()
        state[f"{at}.res_connection.weight"] = first.res_proj.weight.detach()
        state[f"{at}.res_connection.bias"] = torch.zeros(cfg.hidden_size)
        for i, block in enumerate(rest, start=1):
            at = f"hydra_mlp.{k}.{step * i + step - 1}"
            state[f"{at}.linear.weight"], state[f"{at}.linear.bias"] = block.linear.weight.detach(), block.linear.bias.detach()
        weight, bias = full_lm_head(heads, base, k)
        lm = f"hydra_lm_head.{k}.1" if prefix else f"hydra_lm_head.{k}"
        state[f"{lm}.weight"] = weight
        state[f"{lm}.bias"] = torch.zeros(cfg.vocab_size) if bias is None else bias
    if prefix:
        for name, value in heads.prefix_layer.state_dict().items():
            state[f"prefix_embeding_layer.layers.0.{name}"] = value.detach()
        state["prefix_embeding_layer.norm.weight"] = heads.prefix_norm.weight.detach()
        notes.append("the official prefix layer is its vendored Llama layer: rotary base 10000 and one KV head per "
                     "query head; a base with another rotary base or grouped-query attention computes differently")
    if heads.draft_ids is not None:
        notes.append(f"draft vocabulary carried as a bias of {OUTSIDE_DRAFT_VOCAB:g} on the other rows of each "
                     "full-vocabulary LM head")
    config = {"hydra_num_heads": cfg.num_heads, "hydra_num_layers": cfg.num_layers,
              "hydra_head_arch": "prefix-mlp" if prefix else "mlp", "grounded_heads": True,
              "hidden_state_offset": 0, "base_model_name_or_path": cfg.base_model}
    return state, config


def write_hydra(heads: DraftHeads, base_model, folder: Path) -> tuple[list[str], list[str]]:
    notes: list[str] = []
    state, config = _hydra_state(heads, base_model.get_output_embeddings(), notes)
    return write_files(folder, "hydra_lm_head.pt", state, config), notes


def import_hydra(folder: str | Path, base_model, build) -> DraftHeads:
    """Official Hydra heads (hydra_lm_head.pt + config.json), arch mlp (Hydra) or prefix-mlp (Hydra++), grounded;
    own full-vocabulary LM heads with their bias."""
    meta, state, weights = read_files(Path(folder), "hydra_lm_head.pt")
    arch = meta.get("hydra_head_arch", "mlp")
    if arch not in ("mlp", "prefix-mlp") or not meta.get("grounded_heads", False):
        raise ValueError(f"{weights.parent}: hydra_head_arch={arch!r}, grounded_heads={meta.get('grounded_heads')}; "
                         "accepted: mlp or prefix-mlp, grounded (the heads read the path above them)")
    prefix = arch == "prefix-mlp"
    step = 2 if prefix else 1
    num_heads, num_layers = int(meta["hydra_num_heads"]), int(meta["hydra_num_layers"])
    state.pop("input_embed_fn.weight", None)                       # the base embedding, saved along
    config = HeadsConfig.for_base(base_model, family="hydra_pp" if prefix else "hydra", num_heads=num_heads,
                                  num_layers=num_layers, shared_blocks=True)   # the official heads share blocks 1..L-1
    ours = {}
    for k in range(num_heads):
        at = f"hydra_mlp.{k}.{step - 1}"
        for p in ("weight", "bias"):
            ours[f"blocks.{k}.0.linear.{p}"] = state.pop(f"{at}.linear.{p}", None)
        ours[f"blocks.{k}.0.res_proj.weight"] = state.pop(f"{at}.res_connection.weight", None)
        res_bias = state.pop(f"{at}.res_connection.bias", None)
        if res_bias is not None and bool((res_bias != 0).any()):
            raise ValueError(f"{weights}: {at}.res_connection.bias is not zero; these heads' residual projection "
                             "has no bias")
        for i in range(1, num_layers):
            for p in ("weight", "bias"):
                ours[f"blocks.{k}.{i}.linear.{p}"] = state.pop(f"hydra_mlp.{k}.{step * i + step - 1}.linear.{p}", None)
        lm = f"hydra_lm_head.{k}.1" if prefix else f"hydra_lm_head.{k}"
        for p in ("weight", "bias"):
            ours[f"lm_heads.{k}.{p}"] = state.pop(f"{lm}.{p}", None)
    if prefix:
        layer = "prefix_embeding_layer.layers.0."
        for key in [k for k in state if k.startswith(layer)]:
            if not key.endswith("rotary_emb.inv_freq"):
                ours[f"prefix_layer.{key[len(layer):]}"] = state.pop(key)
            else:
                state.pop(key)
        ours["prefix_norm.weight"] = state.pop("prefix_embeding_layer.norm.weight", None)
        state.pop("prefix_embeding_layer.embed_tokens.weight", None)   # built by the official code, never used
    return load_state(config, base_model, ours, state, weights, build)


HYDRA_FORMAT = Format("hydra", ("hydra", "hydra_pp"), write_hydra, import_hydra)
