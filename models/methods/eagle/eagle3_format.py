"""EAGLE-3 heads in the checkpoint layout vLLM's and SGLang's EAGLE-3 loaders read (the authors' layout), and back.

    files, notes = write_eagle3(heads, model, folder)     # config.json + model.safetensors
    heads = read_eagle3(folder, model)                    # a DraftHeads of family eagle3

`model.safetensors` holds `fc.weight` [h, 3h], `midlayer.*` (the one layer: input_layernorm, hidden_norm,
self_attn.{q,k,v}_proj [out, 2h], o_proj, post_attention_layernorm, mlp.{gate,up,down}_proj), `norm.weight` (the
final norm), `lm_head.weight` [Vd, h], `d2t` (int64 [Vd]: target id minus draft index) and `t2d` (bool [V]: the
draft ids). No `embed_tokens.weight`: both loaders take the target model's embedding when the file has none.
`config.json` is a one-layer Llama config with architectures ["LlamaForCausalLMEagle3"], `draft_vocab_size` and
the tapped layers twice, once per loader's convention (see `_tap_fields`). Heads without a draft vocabulary are
written with Vd = V, `d2t` zeros and `t2d` all true. The layer is a Llama layer of the base's sizes whatever the
base's architecture (models/methods/eagle/eagle3.py), as the loaders build it, so heads on any base export: the sizes, norm
eps and rotary written come from that layer's config.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from models.shared import HeadsConfig, check_compatible
from models.shared.draft_vocab import vocab_maps
from models.methods.eagle.eagle_format import check_embedding, check_keys, require_files

WEIGHTS, CONFIG = "model.safetensors", "config.json"
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")   # vLLM registers both; SGLang the first
DEPTHS = 5                                 # read_eagle3's num_heads: conf/heads/eagle3.yaml (the file has none)
# our state-dict prefix -> the file's (first match wins: the layer before the module's other names)
RENAMES = (("eagle3.layers.0.", "midlayer."), ("eagle3.out_norm.", "norm."), ("eagle3.", ""),
           ("lm_heads.0.", "lm_head."))
LAYER_WEIGHTS = ("input_layernorm", "hidden_norm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                 "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FILE_KEYS = ("fc.weight", *(f"midlayer.{name}.weight" for name in LAYER_WEIGHTS), "norm.weight", "lm_head.weight")


def _rename(key: str, pairs) -> str | None:
    """`key` with its prefix replaced by the first matching pair's other side; None when none matches."""
    for src, dst in pairs:
        if key.startswith(src):
            return dst + key[len(src):]
    return None


def to_file_key(key: str) -> str | None:
    """A DraftHeads state-dict key of eagle3 heads -> its name in the file (None: not written, e.g. draft_ids)."""
    return _rename(key, RENAMES)


def to_heads_key(key: str) -> str | None:
    """A file key -> the eagle3 DraftHeads state-dict key it loads into."""
    back = [(dst, src) for src, dst in RENAMES]
    return _rename(key, [pair for pair in back if pair[0]] + [pair for pair in back if not pair[0]])   # "" last


# -- writing -----------------------------------------------------------------------------------------------------
def _lm_head(heads) -> torch.Tensor:
    """[Vd, h]: the heads' one LM head (own, or the base's draft-vocabulary rows when shared); no bias allowed."""
    linear = heads.output_layer(0)
    bias = getattr(linear, "bias", None)
    if bias is not None and bool((bias != 0).any()):
        raise ValueError("the LM head has a non-zero bias; the loaders' EAGLE-3 lm_head has none")
    return linear.weight.detach()


def eagle3_state(heads) -> dict[str, torch.Tensor]:
    """The file's tensors: the module and LM head renamed, d2t and t2d. Any other parameter is refused: the
    loaders' layer has no place for it (the module builds none; a state loaded from elsewhere might hold one)."""
    state = {}
    for key, value in heads.state_dict().items():
        name = to_file_key(key)
        if name is not None:
            state[name] = value.detach()
    extra = sorted(set(state) - set(FILE_KEYS))
    if extra:
        raise ValueError(f"these heads hold {extra[:4]}, which the loaders' Llama EAGLE-3 layer has no place for; "
                         f"accepted keys: {', '.join(FILE_KEYS)}")
    state["lm_head.weight"] = _lm_head(heads)
    state["d2t"], state["t2d"] = vocab_maps(heads.draft_ids, heads.config.vocab_size)
    return {k: v.contiguous().cpu() for k, v in state.items()}


def _rope(config) -> tuple[float | None, dict | None]:
    """(rope_theta, rope_scaling or None for plain rotary) of the layer's Llama config: transformers 5 nests both
    in rope_parameters (rope_scaling is an alias), 4.x keeps them apart."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = params.pop("rope_theta", getattr(config, "rope_theta", None))
    scaling = params if params.get("rope_type", params.get("type", "default")) != "default" else None
    return (None if theta is None else float(theta)), scaling


def loaders_default_taps(num_layers: int) -> tuple[int, int, int]:
    """The layers vLLM and SGLang tap when the config names none (unclamped, unlike models/engine/taps.py's)."""
    return 2, num_layers // 2, num_layers - 3


def _tap_fields(taps: tuple[int, ...]) -> dict:
    """The tapped layers as each loader reads them. Ours are transformers hidden_states indices (the input of
    layer i). vLLM reads a top-level `eagle_aux_hidden_state_layer_ids` in that convention; SGLang reads
    `eagle_config.eagle_aux_hidden_state_layer_ids` as layer outputs counted from 0 (it adds 1)."""
    return {"eagle_aux_hidden_state_layer_ids": list(taps),
            "eagle_config": {"use_aux_hidden_state": True,
                             "eagle_aux_hidden_state_layer_ids": [i - 1 for i in taps]}}


def eagle3_config(heads, base_config, dtype: torch.dtype) -> dict:
    """config.json: the module's one-layer Llama config (the base's sizes), the draft vocabulary and the taps."""
    module = heads.draft_module
    layer = module.layer_config
    theta, scaling = _rope(layer)
    config = {"architectures": [ARCHITECTURES[0]], "model_type": "llama", "num_hidden_layers": 1,
              "hidden_size": layer.hidden_size, "intermediate_size": layer.intermediate_size,
              "num_attention_heads": layer.num_attention_heads, "num_key_value_heads": layer.num_key_value_heads,
              "head_dim": layer.head_dim, "hidden_act": "silu", "rms_norm_eps": layer.rms_norm_eps,
              "rope_theta": theta, "rope_scaling": scaling,
              "max_position_embeddings": layer.max_position_embeddings,
              "vocab_size": heads.config.vocab_size, "draft_vocab_size": heads.config.out_size,
              "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
              "norm_before_residual": False,      # vLLM: the residual is the fused feature before hidden_norm
              "torch_dtype": str(dtype).removeprefix("torch.")}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(base_config, key, None) is not None:
            config[key] = getattr(base_config, key)
    return {**config, **_tap_fields(module.taps)}


def _notes(heads, taps: tuple[int, ...], num_layers: int, dtype: torch.dtype) -> list[str]:
    default = loaders_default_taps(num_layers)
    notes = [f"tapped layers {list(taps)} (hidden_states indices) written twice: eagle_aux_hidden_state_layer_ids "
             f"{list(taps)} for vLLM, eagle_config.eagle_aux_hidden_state_layer_ids {[i - 1 for i in taps]} for "
             "SGLang, which adds 1" + ("" if taps == default else
                                       f"; they differ from the loaders' default {list(default)} for this "
                                       f"{num_layers}-layer base, so a loader that ignores them reads other layers"),
             "no embed_tokens.weight: vLLM and SGLang take the target model's embedding",
             f"weights in {str(dtype).removeprefix('torch.')}; the loaders cast them to the serving dtype"]
    model_type = getattr(heads.draft_module.base_config, "model_type", None)
    if model_type != "llama":
        notes.append(f"base model_type {model_type!r}: the draft layer is a Llama layer of its sizes all the same, "
                     "the one the loaders build for any target")
    if heads.draft_ids is None:
        notes.append("no draft vocabulary: written as the full vocabulary (d2t zeros, t2d all true)")
    if heads.lm_heads is None:
        notes.append("the shared base LM head's rows are written as lm_head.weight: read back, they are the "
                     "heads' own LM head")
    return notes


def write_eagle3(heads, base_model, folder: Path) -> tuple[list[str], list[str]]:
    """Write eagle3 `heads` (attached to `base_model`) to `folder`; -> (files written, notes on what differs)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = eagle3_state(heads)
    config = eagle3_config(heads, base_model.config, state["fc.weight"].dtype)
    save_file(state, str(folder / WEIGHTS), metadata={"format": "pt"})
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    taps = tuple(heads.draft_module.taps)
    notes = _notes(heads, taps, base_model.config.num_hidden_layers, state["fc.weight"].dtype)
    return [str(folder / WEIGHTS), str(folder / CONFIG)], notes


# -- reading -----------------------------------------------------------------------------------------------------
def _check_meta(meta: dict, base_config, module, where: Path) -> None:
    """config.json must describe our layer on this base: one layer, norm after the residual, the base's width, the
    layer's norm eps and rotary base, and our taps (absent taps: the loaders' default, which must then be ours)."""
    taps = tuple(module.taps)
    arch = (meta.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"{where}: architectures={meta.get('architectures')}; accepted: {', '.join(ARCHITECTURES)}")
    theta = _rope(module.layer_config)[0]
    for key, want in (("num_hidden_layers", 1), ("norm_before_residual", False),
                      ("target_hidden_size", base_config.hidden_size),
                      ("rms_norm_eps", module.layer_config.rms_norm_eps), ("rope_theta", theta)):
        if meta.get(key, want) != want:        # the layer here takes the base's norm eps and rotary base
            raise ValueError(f"{where}: {key}={meta[key]!r}; eagle3 heads here need {key}={want!r}")
    L = base_config.num_hidden_layers
    vllm_ids = meta.get("eagle_aux_hidden_state_layer_ids")
    sglang_ids = (meta.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    read = {"eagle_aux_hidden_state_layer_ids": vllm_ids,
            "eagle_config.eagle_aux_hidden_state_layer_ids + 1": None if sglang_ids is None else
            [i + 1 for i in sglang_ids]}
    if vllm_ids is None and sglang_ids is None:
        read = {"the loaders' default (2, L // 2, L - 3)": loaders_default_taps(L)}
    for field, ids in read.items():
        if ids is not None and tuple(ids) != taps:
            raise ValueError(f"{where}: {field} = {list(ids)}, but eagle3 heads here read hidden states "
                             f"{list(taps)} of this {L}-layer base (models/engine/taps.py)")


def _draft_ids(state: dict, vocab_size: int, where: Path) -> torch.Tensor | None:
    """Token ids of the draft vocabulary from d2t (checked against t2d); None for the whole vocabulary in order."""
    d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
    size = state["lm_head.weight"].shape[0] if "lm_head.weight" in state else vocab_size
    if d2t is None:
        if size != vocab_size:
            raise ValueError(f"{where}: lm_head has {size} rows but there is no d2t to map them to token ids")
        d2t = torch.zeros(size, dtype=torch.long)
    ids = d2t.long() + torch.arange(d2t.numel())
    if d2t.numel() != size or int(ids.min()) < 0 or int(ids.max()) >= vocab_size or ids.unique().numel() != size:
        raise ValueError(f"{where}: d2t does not map the {size} lm_head rows to distinct token ids below {vocab_size}")
    if t2d is not None and (t2d.numel() != vocab_size or int(t2d.sum()) != size or not bool(t2d[ids].all())):
        raise ValueError(f"{where}: t2d does not mark exactly the {size} token ids d2t maps to")
    return None if size == vocab_size and torch.equal(ids, torch.arange(size)) else ids


def read_eagle3(folder: str | Path, base_model, build, num_heads: int = DEPTHS):
    """eagle3 DraftHeads (`num_heads` depths measured) on `base_model` from a folder in this format (build: the
    Format reader's, models.methods.build_heads); every key, shape and config field that does not fit is an error
    naming it."""
    folder = Path(folder)
    require_files(folder, (CONFIG, WEIGHTS), "EAGLE-3")
    meta = json.loads((folder / CONFIG).read_text())
    state = dict(load_file(str(folder / WEIGHTS)))
    where = folder / WEIGHTS
    draft_ids = _draft_ids(state, base_model.config.vocab_size, where)
    check_embedding(state, base_model, where)
    config = HeadsConfig.for_base(base_model, family="eagle3", num_heads=num_heads, num_layers=1,
                                  share_lm_head=False, draft_vocab_size=None if draft_ids is None else len(draft_ids))
    check_compatible(config, base_model, source=str(folder))
    heads = build(config, base_model, draft_ids)
    _check_meta(meta, base_model.config, heads.draft_module, folder / CONFIG)
    expected = {to_file_key(k): v for k, v in heads.state_dict().items() if k != "draft_ids"}
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    check_keys(state, expected, where, "EAGLE-3")
    ours = {to_heads_key(k): v.to(expected[k].dtype) for k, v in state.items()}
    if draft_ids is not None:
        ours["draft_ids"] = heads.draft_ids
    heads.load_state_dict(ours, strict=True)
    return heads.eval()
