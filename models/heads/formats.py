"""Trained heads in the formats other code loads, and those formats read back (docs/reference.md#formats-other-tools-load).

    report = export_heads(heads, model, "out/medusa1-vllm", fmt="vllm")     # -> {"format", "files", "notes"}
    heads = import_heads("medusa-vicuna-7b", base_model, fmt="medusa")   # e.g. released official Medusa heads

- medusa: the authors' Medusa code. `medusa_lm_head.pt` ({h}.{l}.linear.weight/bias, {h}.{L}.weight: a full-
  vocabulary LM head without bias) and `config.json` (medusa_num_heads, medusa_num_layers, base_model_name_or_path).
- vllm: vLLM's Medusa model. `model.safetensors` (blocks.{h}.layers.{l}.weight/bias, lm_heads.{h}.weight over the
  draft vocabulary, `token_map` = its full-vocabulary ids) and `config.json` (model_type medusa, num_heads,
  num_hidden_layers, truncated_vocab_size, medusa_fc_bias, original_lm_head).
- hydra: the authors' Hydra code. `hydra_lm_head.pt` (hydra_mlp.{h}..., hydra_lm_head.{h}...; Hydra++ adds
  prefix_embeding_layer.*, and its Dropout modules shift the indices) and `config.json` (hydra_num_heads,
  hydra_num_layers, hydra_head_arch mlp | prefix-mlp, grounded_heads).
- eagle: the authors' EAGLE-1 code (models/heads/eagle_format.py): `pytorch_model.bin` (fc, layers.0, embed_tokens)
  and `config.json` (the base's, one layer).
- eagle3: vLLM's and SGLang's EAGLE-3 loaders (models/heads/eagle3_format.py): `model.safetensors` (fc, midlayer.*,
  norm, lm_head over the draft vocabulary, d2t, t2d) and `config.json` (LlamaForCausalLMEagle3, one layer,
  draft_vocab_size, the tapped layers in each loader's convention).
- speculators: the speculators library's EAGLE-3 checkpoint, which vLLM serves as it is (models/heads/
  speculators_format.py): eagle3's tensors with layers.0.* and embed_tokens, config.json an Eagle3SpeculatorConfig.
  Written only (no import).

What a format cannot hold is refused with the reason, never written approximately; what it holds differently is
listed in the report's notes. The authors' loaders read with strict=False, so a file here has every key they build.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from models.base import model_name
from models.heads import DraftHeads, HeadsConfig, check_compatible
from models.heads.eagle3_format import read_eagle3, write_eagle3
from models.heads.eagle_format import read_eagle, write_eagle
from models.heads.speculators_format import write_speculators

FORMATS = ("medusa", "vllm", "hydra", "eagle", "eagle3", "speculators")
FAMILIES_OF = {"medusa": ("medusa",), "vllm": ("medusa",), "hydra": ("hydra", "hydra_pp"), "eagle": ("eagle",),
               "eagle3": ("eagle3",), "speculators": ("eagle3",)}
WRITERS = {"eagle": write_eagle, "eagle3": write_eagle3, "speculators": write_speculators}   # a module of their own
WHY_NOT = {"speculators": "speculators 0.9 has no layout for them"}    # why a format holds no other family
OUTSIDE_DRAFT_VOCAB = -1e9    # bias of full-vocabulary rows the heads never score: their softmax weight is 0


def _check_exportable(heads: DraftHeads, fmt: str, has_adapter: bool) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r} is not known; accepted: {', '.join(FORMATS)}")
    family = heads.config.family
    if family not in FAMILIES_OF[fmt]:
        fits = [f for f, fams in FAMILIES_OF.items() if family in fams]
        raise ValueError(f"format={fmt} holds {' and '.join(FAMILIES_OF[fmt])} heads, not {family!r} heads"
                         + (f" ({WHY_NOT[fmt]})" if fmt in WHY_NOT else "")
                         + (f"; export them with format={' or format='.join(fits)}" if fits else
                            "; no format here has fields for this family"))
    if has_adapter:
        raise ValueError("these heads were trained with LoRA adapters on the base model (Medusa-2: the adapter/ "
                         "folder); no heads format holds a changed backbone, and the heads alone would draft for "
                         "the unadapted base")
    if not heads.is_attached:
        raise ValueError("attach the heads to their base model first (load_heads does): the shared LM head and the "
                         "embedding live in the base")


def _full_lm_head(heads: DraftHeads, base, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
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
        weight, bias = _full_lm_head(heads, base, k)
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


def export_heads(heads: DraftHeads, base_model, folder: str | Path, fmt: str, has_adapter: bool = False) -> dict:
    """Write `heads` (attached to `base_model`) to `folder` in format `fmt`; -> {"format", "files", "notes"}
    (notes: what differs there)."""
    _check_exportable(heads, fmt, has_adapter)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    cfg = heads.config
    if fmt in WRITERS:
        files, notes = WRITERS[fmt](heads, base_model, folder)
        return {"format": fmt, "files": files, "notes": notes}
    if fmt == "medusa":
        state = _medusa_state(heads, base_model.get_output_embeddings(), notes)
        config = {"medusa_num_heads": cfg.num_heads, "medusa_num_layers": cfg.num_layers,
                  "base_model_name_or_path": cfg.base_model}
        weights = folder / "medusa_lm_head.pt"
        torch.save({k: v.contiguous().cpu() for k, v in state.items()}, weights)
    elif fmt == "vllm":
        state, config = _vllm_state(heads, notes)
        weights = folder / "model.safetensors"
        save_file({k: v.contiguous().cpu() for k, v in state.items()}, str(weights))
    else:
        state, config = _hydra_state(heads, base_model.get_output_embeddings(), notes)
        weights = folder / "hydra_lm_head.pt"
        torch.save({k: v.contiguous().cpu() for k, v in state.items()}, weights)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"format": fmt, "files": [str(weights), str(folder / "config.json")], "notes": notes}


def _read(folder: Path, weights_name: str) -> tuple[dict, dict[str, torch.Tensor], Path]:
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


def _load(config: HeadsConfig, base_model, ours: dict, rest: dict, weights: Path, draft_ids=None) -> DraftHeads:
    """DraftHeads on base_model with exactly the tensors `ours` (its state-dict names); `rest`: the file's keys
    nobody took (an error, as a missing or misshapen key is)."""
    check_compatible(config, base_model, source=str(weights.parent))
    heads = DraftHeads(config, base_model, draft_ids=draft_ids)
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


def _count_heads(state: dict, prefix: str = "") -> int:
    return len({k[len(prefix):].split(".")[0] for k in state if k.startswith(prefix)})


def import_medusa(folder: str | Path, base_model) -> DraftHeads:
    """Official Medusa heads (medusa_lm_head.pt + config.json): own full-vocabulary LM heads with zero bias.
    Released files have been seen to hold more heads than their config names: that is an error naming both."""
    meta, state, weights = _read(Path(folder), "medusa_lm_head.pt")
    num_heads, num_layers = _count_heads(state), int(meta.get("medusa_num_layers", 1))
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
    return _load(config, base_model, ours, state, weights)


def import_vllm(folder: str | Path, base_model) -> DraftHeads:
    """vLLM Medusa heads (model.safetensors + config.json); a token_map becomes the draft vocabulary, and one LM
    head (original_lm_head) equal to the base's rows becomes the shared LM head."""
    meta, state, weights = _read(Path(folder), "model.safetensors")
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
    return _load(config, base_model, ours, state, weights, draft_ids=token_map)


def import_hydra(folder: str | Path, base_model) -> DraftHeads:
    """Official Hydra heads (hydra_lm_head.pt + config.json), arch mlp (Hydra) or prefix-mlp (Hydra++), grounded;
    own full-vocabulary LM heads with their bias."""
    meta, state, weights = _read(Path(folder), "hydra_lm_head.pt")
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
    return _load(config, base_model, ours, state, weights)


IMPORTERS = {"medusa": import_medusa, "vllm": import_vllm, "hydra": import_hydra, "eagle": read_eagle,
             "eagle3": read_eagle3}


def import_heads(folder: str | Path, base_model, fmt: str) -> DraftHeads:
    if fmt not in IMPORTERS:
        raise ValueError(f"format={fmt!r} is not known; accepted: {', '.join(IMPORTERS)}")
    return IMPORTERS[fmt](folder, base_model)
