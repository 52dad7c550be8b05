"""EAGLE-1 heads in the authors' format (`eagle-llm` 1.2.x, EaModel.from_pretrained(ea_model_path=...)) and back.

    files, notes = write_eagle(heads, model, folder)      # config.json + pytorch_model.bin
    files = write_eagle_module(eagle, model, folder)      # a bare EagleModule (full vocabulary), the same layout
    heads = read_eagle(folder, model)                     # a DraftHeads of family eagle, full vocabulary

The folder holds `config.json` (the base's config with num_hidden_layers 1: the draft layer's shape) and
`pytorch_model.bin` with `fc.weight`, `fc.bias`, `layers.0.*` (no input_layernorm: the first layer has none)
and `embed_tokens.weight` (the base embedding, which the authors' module holds a copy of). The authors' drafter
scores the base LM head over the full vocabulary; a draft vocabulary is not carried (see the notes).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from models.shared import HeadsConfig, check_compatible

WEIGHTS, CONFIG = "pytorch_model.bin", "config.json"


def write_eagle(heads, base_model, folder: Path) -> tuple[list[str], list[str]]:
    files = write_eagle_module(heads.draft_module, base_model, folder)
    notes = [] if heads.draft_ids is None else [
        f"the draft vocabulary ({heads.draft_ids.numel()} tokens) is not carried: the authors' drafter scores the "
        "full vocabulary with the base LM head, so its drafts can include tokens these heads never proposed"]
    return files, notes


def write_eagle_module(module, base_model, folder: Path) -> list[str]:
    """A bare EagleModule (models/methods/eagle/eagle.py) in the authors' layout; -> the files written. config.json also
    names the rotary base as `rope_theta` (transformers 4.x reads that key; 5.x nests it in rope_parameters)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    state["embed_tokens.weight"] = base_model.get_input_embeddings().weight.detach().contiguous().cpu()
    config = base_model.config.to_dict()
    config.update({"num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"], "bias": module.fc.bias is not None})
    theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
    if theta is not None:
        config["rope_theta"] = float(theta)
    torch.save(state, folder / WEIGHTS)
    (folder / CONFIG).write_text(json.dumps(config, indent=2, default=str) + "\n")
    return [str(folder / WEIGHTS), str(folder / CONFIG)]


# -- what reading an EAGLE layer's folder checks (this format's and eagle3_format's) ------------------------------
def require_files(folder: Path, names: tuple[str, ...], what: str) -> None:
    for name in names:
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} not found: an {what} folder has {' and '.join(names)}")


def check_embedding(state: dict, base_model, where: Path) -> None:
    """Pops embed_tokens.weight from `state`: when there, it must be the base's (ours is always the base's)."""
    embed = state.pop("embed_tokens.weight", None)
    base = base_model.get_input_embeddings().weight.detach().cpu()
    if embed is not None and (embed.shape != base.shape or not torch.equal(embed.to(base.dtype), base)):
        raise ValueError(f"{where}: embed_tokens.weight is not this base model's embedding "
                         f"({tuple(embed.shape)} against {tuple(base.shape)})")


def check_keys(state: dict, expected: dict, where: Path, what: str) -> None:
    """`state` must have exactly `expected`'s keys, each of its shape."""
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(expected) & set(state) if tuple(state[k].shape) != tuple(expected[k].shape))
    if missing or unexpected or wrong:
        raise ValueError(f"{where} is not an {what} layer for this base: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}, misshapen {wrong[:4]}")


def read_eagle(folder: str | Path, base_model, build):
    folder = Path(folder)
    require_files(folder, (CONFIG, WEIGHTS), "EAGLE")
    meta = json.loads((folder / CONFIG).read_text())
    state = dict(torch.load(folder / WEIGHTS, map_location="cpu", weights_only=True))
    if int(meta.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"{folder / CONFIG}: num_hidden_layers={meta['num_hidden_layers']}; EAGLE-1 has one layer")
    config = HeadsConfig.for_base(base_model, family="eagle", num_heads=5, num_layers=1, share_lm_head=True)
    check_compatible(config, base_model, source=str(folder))
    heads = build(config, base_model)
    check_embedding(state, base_model, folder / WEIGHTS)
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    module = heads.eagle
    expected = module.state_dict()
    check_keys(state, expected, folder / WEIGHTS, "EAGLE-1")
    module.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=True)
    return heads.eval()
