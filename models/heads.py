"""Draft heads: Medusa (independent per depth), Hydra (sequentially dependent), Hydra++.

Indexing (REFERENCE.md section 1): the base LM head at position t predicts token t+1;
draft head k (k = 0..K-1) at position t predicts token t+k+2.

    heads = build_heads(HeadsConfig.for_base(model, family="hydra", num_heads=4), model)
    logits = heads.head_logits(k, h_t, path_tokens)   # path_tokens = x_{t+1} .. x_{t+k+1}
    heads.save("results/heads/hydra");  model, heads = load_heads("results/heads/hydra", model)
"""
from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from models.base import model_name

FAMILIES = ("medusa", "hydra", "hydra_pp")
CONFIG_FILE, WEIGHTS_FILE, ADAPTER_DIR = "heads_config.json", "heads.safetensors", "adapter"


@dataclass
class HeadsConfig:
    family: str
    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    base_model: str
    dropout: float = 0.0
    share_lm_head: bool = False   # True: every head ends in the frozen base LM head (no own Linear)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"heads family {self.family!r} is not known; use one of {list(FAMILIES)}")
        if self.num_heads < 1 or self.num_layers < 1:
            raise ValueError(f"num_heads and num_layers must be >= 1, got {self.num_heads} and {self.num_layers}")

    @classmethod
    def for_base(cls, model, family: str, num_heads: int, num_layers: int = 1, dropout: float = 0.0,
                 share_lm_head: bool = False) -> "HeadsConfig":
        return cls(family=family, num_heads=num_heads, num_layers=num_layers, hidden_size=model.config.hidden_size,
                   vocab_size=model.config.vocab_size, base_model=model_name(model), dropout=dropout,
                   share_lm_head=share_lm_head)


class ResBlock(nn.Module):
    """x + SiLU(W x + b); W starts at zero so a fresh block is the identity."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x):
        return x + F.silu(self.linear(x))


class HydraInputBlock(nn.Module):
    """First Hydra block: [h_t, E(x_{t+1}), ..., E(x_{t+k+1})] (width h*(k+2)) -> h, with a residual projection.

    The residual projection starts as "take h_t" and the MLP at zero, so a fresh Hydra head equals
    a fresh Medusa head (and the base LM head when its Linear is copied from it).
    """

    def __init__(self, hidden: int, num_inputs: int):
        super().__init__()
        self.res_proj = nn.Linear(hidden * num_inputs, hidden, bias=False)
        self.linear = nn.Linear(hidden * num_inputs, hidden)
        with torch.no_grad():
            self.res_proj.weight.zero_()
            self.res_proj.weight[:, :hidden].copy_(torch.eye(hidden))
            self.linear.weight.zero_()

    def forward(self, x):                       # x: [..., h*(k+2)]
        return self.res_proj(x) + F.silu(self.linear(x))


class DraftHeads(nn.Module):
    """All K heads of one family. The base model's embedding and LM head are referenced, never saved."""

    def __init__(self, config: HeadsConfig, base_model=None):
        super().__init__()
        self.config = config
        h, K, L = config.hidden_size, config.num_heads, config.num_layers
        if config.family == "medusa":
            blocks = [nn.Sequential(*[ResBlock(h) for _ in range(L)]) for _ in range(K)]
        else:  # each block its own module: never `[ResBlock(h)] * L`, which shares one
            blocks = [nn.Sequential(HydraInputBlock(h, k + 2), *[ResBlock(h) for _ in range(L - 1)]) for k in range(K)]
        self.blocks = nn.ModuleList(blocks)
        self.dropout = nn.Dropout(config.dropout)
        self.lm_heads = None if config.share_lm_head else nn.ModuleList(
            [nn.Linear(h, config.vocab_size, bias=True) for _ in range(K)])
        self.prefix_layer = None
        self._base = {}
        if base_model is not None:
            self.attach(base_model, init_from_base=True)

    # -- wiring to the base model -------------------------------------------------------------
    def attach(self, base_model, init_from_base: bool = False) -> "DraftHeads":
        """Reference the frozen base embedding / LM head / rotary embedding; optionally initialise from them."""
        decoder = base_model.get_decoder()
        self._base = {"embed": base_model.get_input_embeddings(), "lm_head": base_model.get_output_embeddings(),
                      "rotary": getattr(decoder, "rotary_emb", None)}
        if self.config.family == "hydra_pp" and self.prefix_layer is None:
            # One extra decoder layer of the base architecture; o_proj/down_proj start at zero so its
            # output starts equal to its input (a fresh Hydra++ drafts like a fresh Hydra).
            self.prefix_layer = copy.deepcopy(decoder.layers[-1])
            self.prefix_layer.self_attn.layer_idx = 0
            with torch.no_grad():
                self.prefix_layer.self_attn.o_proj.weight.zero_()
                self.prefix_layer.mlp.down_proj.weight.zero_()
            self.prefix_layer.to(dtype=torch.float32)
        if init_from_base and self.lm_heads is not None:
            base_w = self._base["lm_head"].weight
            base_b = getattr(self._base["lm_head"], "bias", None)
            with torch.no_grad():
                for lin in self.lm_heads:
                    lin.weight.copy_(base_w)
                    if base_b is not None:
                        lin.bias.copy_(base_b)
                    else:
                        lin.bias.zero_()
        return self

    def _require_base(self):
        if not self._base:
            raise RuntimeError("heads are not attached to a base model; call heads.attach(model) first")

    # -- per-head computation ------------------------------------------------------------------
    def head_hidden(self, k: int, hidden: torch.Tensor, path_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden state of head k before its LM head. hidden: [..., h]; path_tokens: [..., k+1] (Hydra)."""
        if self.config.family == "medusa":
            x = hidden
        else:
            self._require_base()
            if path_tokens is None or path_tokens.shape[-1] != k + 1:
                raise ValueError(f"Hydra head {k} needs the {k + 1} path tokens above it, got "
                                 f"{None if path_tokens is None else tuple(path_tokens.shape)}")
            emb = self._base["embed"](path_tokens).to(hidden.dtype)          # [..., k+1, h]
            x = torch.cat([hidden.unsqueeze(-2), emb], dim=-2).flatten(-2)   # [..., h*(k+2)]
        return self.dropout(self.blocks[k](x))

    def lm_head(self, k: int, x: torch.Tensor) -> torch.Tensor:
        if self.lm_heads is not None:
            return self.lm_heads[k](x)
        self._require_base()
        base = self._base["lm_head"]
        return base(x.to(base.weight.dtype))

    def head_logits(self, k: int, hidden: torch.Tensor, path_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [..., V] of head k: the token at t+k+2 given h_t (and x_{t+1..t+k+1} for Hydra)."""
        return self.lm_head(k, self.head_hidden(k, hidden, path_tokens))

    # -- Hydra++ prefix layer ------------------------------------------------------------------
    def prefix_forward(self, hidden: torch.Tensor, position_ids: torch.Tensor, cache=None) -> torch.Tensor:
        """Hydra++: the extra decoder layer over base hidden states, causal. hidden: [B, T, h] -> [B, T, h].

        With a `cache` (a transformers DynamicCache of one layer), earlier positions come from it.
        Other families return `hidden` unchanged.
        """
        if self.prefix_layer is None:
            return hidden
        self._require_base()
        B, T, _ = hidden.shape
        past = cache.get_seq_length() if cache is not None else 0
        dtype = self.prefix_layer.self_attn.o_proj.weight.dtype
        x = hidden.to(dtype)
        causal = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
        mask = torch.zeros(B, 1, T, past + T, dtype=dtype, device=x.device)
        mask.masked_fill_(~causal, torch.finfo(dtype).min)
        pos_emb = self._base["rotary"](x, position_ids)
        out = self.prefix_layer(x, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                                use_cache=cache is not None, position_embeddings=pos_emb)
        out = out[0] if isinstance(out, tuple) else out
        return out.to(hidden.dtype)

    # -- persistence ---------------------------------------------------------------------------
    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=2) + "\n")
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(folder / WEIGHTS_FILE))
        return folder


def build_heads(config: HeadsConfig, base_model) -> DraftHeads:
    return DraftHeads(config, base_model)


def check_compatible(config: HeadsConfig, base_model, source: str = "heads") -> None:
    """A checkpoint must match the base model's hidden size, vocabulary and name."""
    expected = {"hidden_size": base_model.config.hidden_size, "vocab_size": base_model.config.vocab_size,
                "base_model": model_name(base_model)}
    for key, want in expected.items():
        got = getattr(config, key)
        if got != want:
            raise ValueError(f"{source} was trained for {key}={got!r} but the base model has {key}={want!r}; "
                             "train heads for this base model or load the matching one")


def load_heads(folder: str | Path, base_model):
    """(base model, heads) from a heads folder; applies and merges a Medusa-2 LoRA adapter when present."""
    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{folder} is not a heads folder (no {CONFIG_FILE}); train it with "
                                "`python -m pipelines.train heads=...`")
    config = HeadsConfig(**json.loads((folder / CONFIG_FILE).read_text()))
    check_compatible(config, base_model, source=str(folder))
    if (folder / ADAPTER_DIR).is_dir():
        from peft import PeftModel

        base_model = PeftModel.from_pretrained(base_model, str(folder / ADAPTER_DIR)).merge_and_unload().eval()
    heads = DraftHeads(config)
    heads.attach(base_model)  # creates the Hydra++ prefix layer so its weights have a place to load into
    state = load_file(str(folder / WEIGHTS_FILE))
    missing, unexpected = heads.load_state_dict(state, strict=False)
    if missing or unexpected:  # checked by hand to name the keys: a partial load must never pass silently
        raise ValueError(f"{folder / WEIGHTS_FILE} does not match a {config.family} heads module: "
                         f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    return base_model, heads.to(next(base_model.parameters()).device).eval()
