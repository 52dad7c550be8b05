"""Medusa heads in the formats other code loads, listed by Medusa's Method (models/shared/formats.py: the contract):
`medusa` (the authors' Medusa code: medusa_lm_head.pt + config.json) and `vllm` (vLLM's Medusa model:
model.safetensors + config.json); the layouts are described there.
"""
from __future__ import annotations

from pathlib import Path

import torch

from models.shared import DraftHeads, HeadsConfig
from models.shared.formats import Format, count_heads, load_state, read_files, write_files


def _medusa_state(heads: DraftHeads, base, notes: list[str]) -> dict[str, torch.Tensor]:
    cfg = heads.config
    if cfg.num_layers > 1:
        raise ValueError(f"num_layers={cfg.num_layers}: the official Medusa code builds a head's blocks as one "
                         "module repeated ([ResBlock] * L), so heads with distinct blocks cannot load there; "
                         "format=vllm keeps them")
    if heads.lm_heads is not None:
        raise ValueError("these heads have their own LM heads, with a bias (and over the draft vocabulary when they "
                         "have one); the official Medusa LM head is a full-vocabulary Linear without bias; "
                         "format=hydra holds own LM heads")
    if getattr(base, "bias", None) is not None:
        raise ValueError("the base LM head has a bias, which the official Medusa LM head (no bias) cannot hold")
    state = {}
    for k in range(cfg.num_heads):
        block = heads.blocks[k][0].linear
        state[f"{k}.0.linear.weight"], state[f"{k}.0.linear.bias"] = block.weight.detach(), block.bias.detach()
        state[f"{k}.1.weight"] = base.weight.detach()       # the shared LM head, full vocabulary
    if heads.draft_ids is not None:
        notes.append(f"draft vocabulary not carried (the format has no token map): the exported heads score all "
                     f"{cfg.vocab_size} tokens, so their top-k can differ from these heads' over "
                     f"{cfg.draft_vocab_size}; format=vllm keeps it (token_map)")
    return state


def _vllm_state(heads: DraftHeads, notes: list[str]) -> tuple[dict[str, torch.Tensor], dict]:
    cfg = heads.config
    state = {}
    for k in range(cfg.num_heads):
        for i, block in enumerate(heads.blocks[k]):
            state[f"blocks.{k}.layers.{i}.weight"] = block.linear.weight.detach()
            state[f"blocks.{k}.layers.{i}.bias"] = block.linear.bias.detach()
    if heads.lm_heads is None:   # one LM head for all: vLLM's original_lm_head
        weight, bias = heads.base_output_weights()
        if bias is not None:
            raise ValueError("the base LM head has a bias, which vLLM's Medusa LM head cannot hold")
        state["lm_heads.0.weight"] = weight.detach()
    else:
        for k, lin in enumerate(heads.lm_heads):
            if bool((lin.bias != 0).any()):
                raise ValueError("these heads' own LM heads have a bias, which vLLM's Medusa LM head "
                                 "(ParallelLMHead without bias) cannot hold")
            state[f"lm_heads.{k}.weight"] = lin.weight.detach()
    if heads.draft_ids is not None:
        state["token_map"] = heads.draft_ids.detach().long()
    config = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": cfg.hidden_size,
              "vocab_size": cfg.vocab_size, "num_heads": cfg.num_heads, "num_hidden_layers": cfg.num_layers,
              "truncated_vocab_size": cfg.out_size, "medusa_fc_bias": True,
              "original_lm_head": heads.lm_heads is None, "max_paths": 64, "topk": 10}
    notes.append("vLLM drafts a chain from each head's argmax, not a tree")
    return state, config


def write_medusa(heads: DraftHeads, base_model, folder: Path) -> tuple[list[str], list[str]]:
    notes: list[str] = []
    cfg = heads.config
    state = _medusa_state(heads, base_model.get_output_embeddings(), notes)
    config = {"medusa_num_heads": cfg.num_heads, "medusa_num_layers": cfg.num_layers,
              "base_model_name_or_path": cfg.base_model}
    return write_files(folder, "medusa_lm_head.pt", state, config), notes


def write_vllm(heads: DraftHeads, base_model, folder: Path) -> tuple[list[str], list[str]]:
    notes: list[str] = []
    state, config = _vllm_state(heads, notes)
    return write_files(folder, "model.safetensors", state, config), notes


def import_medusa(folder: str | Path, base_model, build) -> DraftHeads:
    """Official Medusa heads (medusa_lm_head.pt + config.json): own full-vocabulary LM heads with zero bias.
    Released files have been seen to hold more heads than their config names: that is an error naming both."""
    meta, state, weights = read_files(Path(folder), "medusa_lm_head.pt")
    num_heads, num_layers = count_heads(state), int(meta.get("medusa_num_layers", 1))
    if meta.get("medusa_num_heads") not in (None, num_heads):
        raise ValueError(f"{weights} holds {num_heads} heads but config.json says medusa_num_heads="
                         f"{meta['medusa_num_heads']}; set the config to the file's count")
    config = HeadsConfig.for_base(base_model, family="medusa", num_heads=num_heads, num_layers=num_layers)
    ours = {}
    for k in range(num_heads):
        for layer in range(num_layers):
            for p in ("weight", "bias"):
                ours[f"blocks.{k}.{layer}.linear.{p}"] = state.pop(f"{k}.{layer}.linear.{p}", None)
        ours[f"lm_heads.{k}.weight"] = state.pop(f"{k}.{num_layers}.weight", None)
        ours[f"lm_heads.{k}.bias"] = torch.zeros(config.vocab_size)
    return load_state(config, base_model, ours, state, weights, build)


def import_vllm(folder: str | Path, base_model, build) -> DraftHeads:
    """vLLM Medusa heads (model.safetensors + config.json); a token_map becomes the draft vocabulary, and one LM
    head (original_lm_head) equal to the base's rows becomes the shared LM head."""
    meta, state, weights = read_files(Path(folder), "model.safetensors")
    num_heads, num_layers = int(meta["num_heads"]), int(meta["num_hidden_layers"])
    token_map = state.pop("token_map", None)
    shared = bool(meta.get("original_lm_head"))
    config = HeadsConfig.for_base(base_model, family="medusa", num_heads=num_heads, num_layers=num_layers,
                                  share_lm_head=shared, draft_vocab_size=None if token_map is None else len(token_map))
    ours = {}
    for k in range(num_heads):
        for layer in range(num_layers):
            ours[f"blocks.{k}.{layer}.linear.weight"] = state.pop(f"blocks.{k}.layers.{layer}.weight", None)
            bias = state.pop(f"blocks.{k}.layers.{layer}.bias", None)
            ours[f"blocks.{k}.{layer}.linear.bias"] = bias if bias is not None or meta.get("medusa_fc_bias") else \
                torch.zeros(config.hidden_size)
        if not shared:
            ours[f"lm_heads.{k}.weight"] = state.pop(f"lm_heads.{k}.weight", None)
            ours[f"lm_heads.{k}.bias"] = torch.zeros(config.out_size)
    if shared:
        weight = state.pop("lm_heads.0.weight", None)
        base = base_model.get_output_embeddings().weight.detach()
        rows = base if token_map is None else base[token_map.long()]
        if weight is None or weight.shape != rows.shape or not torch.equal(weight.to(rows.dtype), rows):
            raise ValueError(f"{weights}: original_lm_head is set but lm_heads.0.weight is not this base model's "
                             "LM head" + ("" if token_map is None else " rows for token_map"))
    return load_state(config, base_model, ours, state, weights, build, draft_ids=token_map)


MEDUSA_FORMAT = Format("medusa", ("medusa",), write_medusa, import_medusa)
VLLM_FORMAT = Format("vllm", ("medusa",), write_vllm, import_vllm)
