"""Trained heads in the formats other code loads, and those formats read back (docs/reference.md#formats-other-tools-load).

    report = export_heads(heads, model, "out/medusa1-vllm", fmt="vllm")     # -> {"format", "files", "notes"}
    heads = import_heads("medusa-vicuna-7b", base_model, fmt="medusa")   # e.g. released official Medusa heads

Each method declares its formats where its code is (models/methods/medusa/formats.py for medusa and vllm,
models/methods/hydra/formats.py for hydra, models/methods/eagle/ for eagle, eagle3 and speculators) and lists them in
its Method; models.methods.export_heads / import_heads look them up there. This module holds the Format contract,
export_heads / import_heads over a given set of formats and what the writers and readers share.

- medusa: the authors' Medusa code. `medusa_lm_head.pt` ({h}.{l}.linear.weight/bias, {h}.{L}.weight: a full-
  vocabulary LM head without bias) and `config.json` (medusa_num_heads, medusa_num_layers, base_model_name_or_path).
- vllm: vLLM's Medusa model. `model.safetensors` (blocks.{h}.layers.{l}.weight/bias, lm_heads.{h}.weight over the
  draft vocabulary, `token_map` = its full-vocabulary ids) and `config.json` (model_type medusa, num_heads,
  num_hidden_layers, truncated_vocab_size, medusa_fc_bias, original_lm_head).
- hydra: the authors' Hydra code. `hydra_lm_head.pt` (hydra_mlp.{h}..., hydra_lm_head.{h}...; Hydra++ adds
  prefix_embeding_layer.*, and its Dropout modules shift the indices) and `config.json` (hydra_num_heads,
  hydra_num_layers, hydra_head_arch mlp | prefix-mlp, grounded_heads).
- eagle: the authors' EAGLE-1 code (models/methods/eagle/eagle_format.py): `pytorch_model.bin` (fc, layers.0, embed_tokens)
  and `config.json` (the base's, one layer).
- eagle3: vLLM's and SGLang's EAGLE-3 loaders (models/methods/eagle/eagle3_format.py): `model.safetensors` (fc, midlayer.*,
  norm, lm_head over the draft vocabulary, d2t, t2d) and `config.json` (LlamaForCausalLMEagle3, one layer,
  draft_vocab_size, the tapped layers in each loader's convention).
- speculators: the speculators library's checkpoints, which vLLM serves as they are, written only (no import):
  EAGLE-3's (models/methods/eagle/speculators_format.py: eagle3's tensors with layers.0.* and embed_tokens,
  config.json an Eagle3SpeculatorConfig) and DFlash's (models/methods/dflash/speculators_format.py: the authors'
  tensor names, config.json a DFlashSpeculatorConfig).
- dflash: the authors' DFlash code (models/methods/dflash/dflash_format.py).

What a format cannot hold is refused with the reason, never written approximately; what it holds differently is
listed in the report's notes. The authors' loaders read with strict=False, so a file here has every key they build.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from models.base import model_name
from models.shared.draft_heads import DraftHeads, HeadsConfig, check_compatible

OUTSIDE_DRAFT_VOCAB = -1e9    # bias of full-vocabulary rows the heads never score: their softmax weight is 0


@dataclass(frozen=True)
class Format:
    """A format other code loads: the families whose heads it holds, its writer (heads, base_model, folder) ->
    (files, notes), its reader (folder, base_model, build) -> heads (None: written only; build(config, base_model,
    draft_ids) makes the heads a config names: models.methods.build_heads), and why it holds no other family."""
    name: str
    families: tuple[str, ...]
    write: Callable
    read: Callable | None = None
    why_not: str | None = None


def by_name(formats) -> dict[str, Format]:
    """Formats by name, in order. Where methods list formats of one name (speculators: EAGLE-3's layout and
    DFlash's), one Format holds all their families and writes (reads) each family with its own method's code."""
    groups: dict[str, list[Format]] = {}
    for f in formats:
        group = groups.setdefault(f.name, [])
        if not any(f is g for g in group):            # one Format two methods list (hydra, hydra_pp): once
            group.append(f)
    return {name: group[0] if len(group) == 1 else _joined(group) for name, group in groups.items()}


def _joined(group: list[Format]) -> Format:
    def own(heads_or_family):
        family = heads_or_family if isinstance(heads_or_family, str) else heads_or_family.config.family
        return next(f for f in group if family in f.families)

    readers = [f for f in group if f.read is not None]
    if len(readers) > 1:
        raise ValueError(f"format {group[0].name!r} is read by {len(readers)} methods' code; only one may read it")
    return Format(group[0].name, tuple(fam for f in group for fam in f.families),
                  lambda heads, base_model, folder: own(heads).write(heads, base_model, folder),
                  readers[0].read if readers else None, group[0].why_not)


def _check_exportable(heads: DraftHeads, fmt: str, formats: dict[str, Format], has_adapter: bool) -> None:
    if fmt not in formats:
        raise ValueError(f"format={fmt!r} is not known; accepted: {', '.join(formats)}")
    family, holds = heads.config.family, formats[fmt].families
    if family not in holds:
        fits = [f.name for f in formats.values() if family in f.families]
        raise ValueError(f"format={fmt} holds {' and '.join(holds)} heads, not {family!r} heads"
                         + (f" ({formats[fmt].why_not})" if formats[fmt].why_not else "")
                         + (f"; export them with format={' or format='.join(fits)}" if fits else
                            "; no format here has fields for this family"))
    if has_adapter:
        raise ValueError("these heads were trained with LoRA adapters on the base model (Medusa-2: the adapter/ "
                         "folder); no heads format holds a changed backbone, and the heads alone would draft for "
                         "the unadapted base")
    if not heads.is_attached:
        raise ValueError("attach the heads to their base model first (load_heads does): the shared LM head and the "
                         "embedding live in the base")


def full_lm_head(heads: DraftHeads, base, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Head k's LM head over the full vocabulary: (weight [V, h], bias [V] or None). Rows outside the draft
    vocabulary keep the base's weights (shared head) or zeros (own head); their bias is OUTSIDE_DRAFT_VOCAB."""
    cfg = heads.config
    own = heads.lm_heads[k] if heads.lm_heads is not None else None
    base_bias = getattr(base, "bias", None)
    if heads.draft_ids is None:
        if own is None:
            return base.weight.detach(), None if base_bias is None else base_bias.detach()
        return own.weight.detach(), own.bias.detach()
    weight = base.weight.detach().clone() if own is None else torch.zeros(cfg.vocab_size, cfg.hidden_size)
    bias = torch.full((cfg.vocab_size,), OUTSIDE_DRAFT_VOCAB)
    src_w, src_b = heads.base_output_weights() if own is None else (own.weight.detach(), own.bias.detach())
    weight[heads.draft_ids] = src_w.to(weight.dtype)
    bias[heads.draft_ids] = 0.0 if src_b is None else src_b.to(bias.dtype)
    return weight, bias


def export_heads(heads: DraftHeads, base_model, folder: str | Path, fmt: str, formats: dict[str, Format],
                 has_adapter: bool = False) -> dict:
    """Write `heads` (attached to `base_model`) to `folder` in format `fmt`, one of `formats` (by name); ->
    {"format", "files", "notes"} (notes: what differs there)."""
    _check_exportable(heads, fmt, formats, has_adapter)
    folder = Path(folder)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        files, notes = formats[fmt].write(heads, base_model, folder)
    except Exception:
        if created:                   # a refused or failed export leaves no folder of its own behind
            shutil.rmtree(folder, ignore_errors=True)
        raise
    return {"format": fmt, "files": files, "notes": notes}


def write_files(folder: Path, weights_name: str, state: dict[str, torch.Tensor], config: dict) -> list[str]:
    """state to folder/weights_name (a .safetensors file, else torch.save) and config to folder/config.json."""
    weights = folder / weights_name
    state = {k: v.contiguous().cpu() for k, v in state.items()}
    if weights.suffix == ".safetensors":
        from safetensors.torch import save_file
        save_file(state, str(weights))
    else:
        torch.save(state, weights)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return [str(weights), str(folder / "config.json")]


def read_files(folder: Path, weights_name: str) -> tuple[dict, dict[str, torch.Tensor], Path]:
    cfg_path, weights = folder / "config.json", folder / weights_name
    for path in (cfg_path, weights):
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: this format's folder has config.json and {weights_name}")
    if weights.suffix == ".safetensors":
        from safetensors.torch import load_file
        state = load_file(str(weights))
    else:
        state = torch.load(weights, map_location="cpu", weights_only=True)
    return json.loads(cfg_path.read_text()), dict(state), weights


def load_state(config: HeadsConfig, base_model, ours: dict, rest: dict, weights: Path, build,
               draft_ids=None) -> DraftHeads:
    """DraftHeads on base_model (made by build, Format's) with exactly the tensors `ours` (its state-dict names);
    `rest`: the file's keys nobody took (an error, as a missing or misshapen key is)."""
    check_compatible(config, base_model, source=str(weights.parent))
    heads = build(config, base_model, draft_ids=draft_ids)
    expected = heads.state_dict()
    missing = [k for k, v in ours.items() if v is None] + [k for k in expected if k not in ours and k != "draft_ids"]
    if missing or rest:
        raise ValueError(f"{weights} is not a {config.num_heads}-head, {config.num_layers}-layer {config.family} file "
                         f"for this base: missing {missing[:4]}, unexpected {sorted(rest)[:4]}")
    for key, value in ours.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise ValueError(f"{weights}: {key} has shape {tuple(value.shape)}; the base model "
                             f"{model_name(base_model)} needs {tuple(expected[key].shape)}")
    heads.load_state_dict({**ours, **({"draft_ids": expected["draft_ids"]} if "draft_ids" in expected else {})},
                          strict=True)
    return heads.eval()


def count_heads(state: dict, prefix: str = "") -> int:
    return len({k[len(prefix):].split(".")[0] for k in state if k.startswith(prefix)})


def import_heads(folder: str | Path, base_model, fmt: str, formats: dict[str, Format], build) -> DraftHeads:
    """Heads read from `folder` in format `fmt`, one of `formats` (by name); build: see Format."""
    readable = [name for name, f in formats.items() if f.read is not None]
    if fmt not in readable:
        raise ValueError(f"format={fmt!r} is not known; accepted: {', '.join(readable)}")
    return formats[fmt].read(folder, base_model, build)
