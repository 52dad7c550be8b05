"""DraftHeads: a method's trained module (the K heads of one family, or an autoregressive method's draft module beside
its LM head), its config, building, saving and loading (the package docstring, models/shared/__init__.py, shows the
use). build_heads and load_heads make the heads class of a given method's family (a subclass a method may define in
its own package); models.methods.build_heads and load_heads find the method a config names."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from models.base import model_name
from models.shared.draft_vocab import check_draft_ids, index_in_draft
from models.shared.families import share_res_blocks

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
    draft_vocab_size: int | None = None   # heads score this many tokens (DraftHeads.draft_ids); None: all
    shared_blocks: bool = False   # True: a head's ResBlocks are one module applied in turn, as the authors build them
    mask_token_id: int | None = None   # a block drafter's mask (DFlash, DSpark): an id of the base's vocabulary, whose
    #                                    frozen row it takes; None: its own token (id vocab_size, a learned embedding)
    sample_from_anchor: bool = False   # a block drafter's slot k drafts the token k + 1 after the anchor (the
    #                                    speculators library's DSpark default); False: the token k after it (DFlash's)

    def __post_init__(self):
        if self.num_heads < 1 or self.num_layers < 1:
            raise ValueError(f"num_heads and num_layers must be >= 1, got {self.num_heads} and {self.num_layers}")
        if not isinstance(self.shared_blocks, bool):
            raise ValueError(f"shared_blocks={self.shared_blocks!r} is not accepted; it takes true (a head's "
                             "ResBlocks are one module, as the authors' [ResBlock] * L) or false (each its own)")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be between 1 and vocab_size="
                             f"{self.vocab_size}, or None for the full vocabulary")
        m = self.mask_token_id
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or not 0 <= m < self.vocab_size):
            raise ValueError(f"heads.mask_token_id={m!r} is not accepted; it takes null (the drafter's own mask token, "
                             f"id {self.vocab_size}, a learned embedding) or an id of the base's vocabulary, 0 to "
                             f"{self.vocab_size - 1} (its frozen embedding row)")
        if not isinstance(self.sample_from_anchor, bool):
            raise ValueError(f"heads.sample_from_anchor={self.sample_from_anchor!r} is not accepted; it takes true "
                             "(slot k drafts the token k + 1 after the anchor) or false (the token k after it)")

    @property
    def out_size(self) -> int:
        """Logits per head: the draft vocabulary's size (the full vocabulary's without one)."""
        return self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size

    @classmethod
    def for_base(cls, model, family: str, num_heads: int, num_layers: int = 1, dropout: float = 0.0,
                 share_lm_head: bool = False, draft_vocab_size: int | None = None,
                 shared_blocks: bool = False, mask_token_id: int | None = None,
                 sample_from_anchor: bool = False) -> "HeadsConfig":
        return cls(family=family, num_heads=num_heads, num_layers=num_layers, hidden_size=model.config.hidden_size,
                   vocab_size=model.config.vocab_size, base_model=model_name(model), dropout=dropout,
                   share_lm_head=share_lm_head, draft_vocab_size=draft_vocab_size, shared_blocks=shared_blocks,
                   mask_token_id=mask_token_id, sample_from_anchor=sample_from_anchor)


class DraftHeads(nn.Module):
    """All K heads of one family, or the module of an autoregressive one. The base model's embedding and LM head are
    referenced, never saved. Dropout runs before every block and before the LM head.

    A method whose module holds more than the heads subclasses it (its family's `heads_class`): it declares its own
    submodules in __init__ and builds them from the base in build_parts (Hydra++: its prefix layer,
    models/methods/hydra/prefix.py; EAGLE: its layer, models/shared/autoregressive/heads.py). `method` is the Method
    (models/shared/method.py) whose family the config names: the heads carry it, so that whoever is handed them
    (the engine: heads.method.proposer) needs no lookup.
    """
    draft_module = None       # an autoregressive method's module, run over its own outputs (models/shared/autoregressive/draft.py)

    def __init__(self, config: HeadsConfig, base_model=None, draft_ids: torch.Tensor | None = None, *, method):
        super().__init__()
        if method.name != config.family:
            raise ValueError(f"heads of family {config.family!r} built with the method {method.name!r}")
        self.config, self.method = config, method
        if not method.family.block_drafter and (config.mask_token_id is not None or config.sample_from_anchor):
            raise ValueError(f"heads.mask_token_id and heads.sample_from_anchor are a block drafter's (dflash, "
                             f"dspark); family {config.family!r} takes neither (got {config.mask_token_id!r}, "
                             f"{config.sample_from_anchor!r})")
        h, K, L, Vd = config.hidden_size, config.num_heads, config.num_layers, config.out_size
        self.family = method.family
        self.blocks = self.family.build_blocks(h, K, L)
        if config.shared_blocks:
            share_res_blocks(self.blocks)
        self.dropout = nn.Dropout(config.dropout)
        self.lm_heads = None if config.share_lm_head else nn.ModuleList(
            [nn.Linear(h, Vd, bias=self.family.lm_head_bias) for _ in range(self.family.num_lm_heads(K))])
        if config.draft_vocab_size is None:
            if draft_ids is not None:
                raise ValueError("draft_ids given but config.draft_vocab_size is None (full vocabulary)")
            self.register_buffer("draft_ids", None)
            self.register_buffer("draft_index", None)
        else:
            if draft_ids is None:
                raise ValueError(f"config.draft_vocab_size={config.draft_vocab_size} needs its draft_ids "
                                 "(models/shared/draft_vocab.py most_frequent)")
            draft_ids = torch.as_tensor(draft_ids)
            check_draft_ids(draft_ids, config.vocab_size, config.draft_vocab_size)
            self.register_buffer("draft_ids", draft_ids.long().clone())                         # [Vd], saved
            self.register_buffer("draft_index", index_in_draft(self.draft_ids, config.vocab_size),
                                 persistent=False)                                               # [V]
        # the base LM head's rows for draft_ids (draft vocabulary only): the shared LM head, the Hydra++
        # teacher and the initial own LM heads; frozen, rebuilt on attach, never saved
        self.register_buffer("base_rows_weight", None, persistent=False)   # [Vd, h]
        self.register_buffer("base_rows_bias", None, persistent=False)     # [Vd] when the base LM head has a bias
        self._frozen_linear: dict = {}
        self._base = {}
        if base_model is not None:
            self.attach(base_model, init_from_base=True)

    # -- wiring to the base model -------------------------------------------------------------
    def attach(self, base_model, init_from_base: bool = False) -> "DraftHeads":
        """Reference the frozen base embedding / LM head / rotary embedding; optionally initialise from them."""
        decoder = base_model.get_decoder()
        lm_head = base_model.get_output_embeddings()
        self._base = {"embed": base_model.get_input_embeddings(), "lm_head": lm_head,
                      "rotary": getattr(decoder, "rotary_emb", None)}
        if self.draft_ids is not None:
            ids = self.draft_ids.to(lm_head.weight.device)
            base_b = getattr(lm_head, "bias", None)
            self.base_rows_weight = lm_head.weight.detach()[ids].clone()
            self.base_rows_bias = None if base_b is None else base_b.detach()[ids].clone()
        self.build_parts(base_model)                    # a subclass's own modules (Hydra++: its prefix layer)
        if init_from_base and self.lm_heads is not None and self.family.lm_head_from_base:
            weight, bias = self.base_output_weights()
            with torch.no_grad():
                for lin in self.lm_heads:
                    lin.weight.copy_(weight)
                    if lin.bias is None:
                        continue
                    if bias is not None:
                        lin.bias.copy_(bias)
                    else:
                        lin.bias.zero_()
        return self

    def build_parts(self, base_model) -> None:
        """A subclass's own modules beside the heads' blocks, made from the base model on the first attach (a later
        attach keeps them); after the heads' blocks and LM heads, before the LM heads are copied from the base.
        None here."""

    @property
    def is_attached(self) -> bool:
        """Whether attach(base_model) has wired the frozen base embedding / LM head in."""
        return bool(self._base)

    def _require_base(self):
        if not self._base:
            raise RuntimeError("heads are not attached to a base model; call heads.attach(model) first")

    def base_output_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight [Vd, h], bias [Vd] or None): the frozen base LM head restricted to the draft vocabulary."""
        self._require_base()
        if self.draft_ids is not None:
            return self.base_rows_weight, self.base_rows_bias
        base = self._base["lm_head"]
        return base.weight, getattr(base, "bias", None)

    def output_layer(self, k: int) -> nn.Linear:
        """The Linear head k ends in ([h] -> [Vd]): its own, or the frozen base LM head (its draft-vocabulary rows)."""
        if self.lm_heads is not None:
            return self.lm_heads[min(k, len(self.lm_heads) - 1)]      # autoregressive families: one for all depths
        self._require_base()
        if self.draft_ids is None:
            return self._base["lm_head"]
        weight, bias = self.base_output_weights()
        key = (weight.data_ptr(), weight.device, weight.dtype)
        if self._frozen_linear.get("key") != key:   # a frozen Linear over the buffers (no copy), remade after .to()
            lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
            lin.weight = nn.Parameter(weight, requires_grad=False)
            if bias is not None:
                lin.bias = nn.Parameter(bias, requires_grad=False)
            self._frozen_linear = {"key": key, "linear": lin}
        return self._frozen_linear["linear"]

    def output_layers(self) -> list[nn.Linear]:
        """output_layer(k) of every head (the same module for heads sharing the frozen LM head)."""
        layers = [self.output_layer(k) for k in range(self.config.num_heads)]
        return list({id(layer): layer for layer in layers}.values())

    # -- draft vocabulary ----------------------------------------------------------------------
    def to_token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Positions in the draft vocabulary (e.g. top-k indices of draft_logits) -> token ids."""
        return index if self.draft_ids is None else self.draft_ids[index]

    def to_draft_index(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> positions in the draft vocabulary, -1 for tokens outside it."""
        return token_ids if self.draft_ids is None else self.draft_index[token_ids]

    # -- per-head computation ------------------------------------------------------------------
    def head_hidden(self, k: int, hidden: torch.Tensor, path_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden state of head k before its LM head. hidden: [..., h]; path_tokens: [..., k+1] (Hydra)."""
        if self.family.reads_path:
            self._require_base()
        x = self.family.head_input(k, hidden, path_tokens, self._base.get("embed"))
        for block in self.blocks[k]:                                          # dropout before every block
            x = block(self.dropout(x))
        return self.dropout(x)                                                # and before the LM head

    def lm_head(self, k: int, x: torch.Tensor) -> torch.Tensor:
        """[..., h] -> [..., Vd] logits over the draft vocabulary."""
        linear = self.output_layer(k)
        return linear(x.to(linear.weight.dtype))

    reads_whole_path = False     # block_logits of a path's last position needs every slot from the root's on (DSpark's rnn)

    def block_logits(self, out: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
        """A draft module's outputs at K positions of a path [..., K, h] -> their logits [..., K, Vd]; prev [..., K]:
        the token before each position, which a method may read (DSpark's Markov bias); here the LM head alone."""
        return self.lm_head(0, out)

    def draft_logits(self, k: int, hidden: torch.Tensor, path_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [..., Vd] of head k over the draft vocabulary (to_token_ids maps positions to token ids)."""
        return self.lm_head(k, self.head_hidden(k, hidden, path_tokens))

    def head_logits(self, k: int, hidden: torch.Tensor, path_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [..., V] of head k over the full vocabulary: the token at t+k+2 given h_t (and x_{t+1..t+k+1}
        for Hydra); -inf outside the draft vocabulary, so softmax gives the head's distribution over all tokens."""
        logits = self.draft_logits(k, hidden, path_tokens)
        if self.draft_ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_ids, logits)

    def base_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The frozen base LM head over the draft vocabulary: [..., h] -> [..., Vd] (the Hydra++ teacher)."""
        weight, bias = self.base_output_weights()
        return F.linear(hidden.to(weight.dtype), weight, bias)

    def read_hidden(self, hidden: torch.Tensor, position_ids: torch.Tensor, cache=None) -> torch.Tensor:
        """What the heads read of the base's hidden states [B, T, h] at position_ids [B, T]: the states themselves. A
        method that runs a layer over them first overrides it (Hydra++: its prefix layer, with its own KV cache)."""
        return hidden

    # -- persistence ---------------------------------------------------------------------------
    def save(self, folder: str | Path) -> Path:
        """heads_config.json (with draft_vocab_size) + heads.safetensors (with the draft_ids tensor)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=2) + "\n")
        state, seen = {}, set()
        for k, v in self.state_dict().items():     # a shared block is under each of its names: one copy each
            v = v.detach().contiguous().cpu()
            state[k] = v.clone() if v.data_ptr() in seen else v
            seen.add(v.data_ptr())
        save_file(state, str(folder / WEIGHTS_FILE))
        return folder


def build_heads(config: HeadsConfig, method, base_model, draft_ids: torch.Tensor | None = None) -> DraftHeads:
    """The heads of `method` (a Method, models/shared/method.py: its family's heads class) for config."""
    return (method.family.heads_class or DraftHeads)(config, base_model, draft_ids, method=method)


def check_compatible(config: HeadsConfig, base_model, source: str = "heads") -> None:
    """A checkpoint must match the base model's hidden size, vocabulary and name."""
    expected = {"hidden_size": base_model.config.hidden_size, "vocab_size": base_model.config.vocab_size,
                "base_model": model_name(base_model)}
    for key, want in expected.items():
        got = getattr(config, key)
        if got != want:
            raise ValueError(f"{source} was trained for {key}={got!r} but the base model has {key}={want!r}; "
                             "train heads for this base model or load the matching one")


def load_heads(folder: str | Path, base_model, method_named):
    """(base model, heads) from a heads folder; applies and merges a Medusa-2 LoRA adapter when present.
    method_named(name) -> the Method of the family the folder's config names (models.methods.method)."""
    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{folder} is not a heads folder (no {CONFIG_FILE}); train it with "
                                "`python -m pipelines.train heads=...`")
    raw = json.loads((folder / CONFIG_FILE).read_text())
    method = method_named(raw["family"])
    config = HeadsConfig(**method.family.config_from_file(raw))
    check_compatible(config, base_model, source=str(folder))
    state = load_file(str(folder / WEIGHTS_FILE))
    draft_ids = state.get("draft_ids")
    if config.draft_vocab_size is not None:
        if draft_ids is None:
            raise ValueError(f"{folder / WEIGHTS_FILE} has no draft_ids tensor but {CONFIG_FILE} says "
                             f"draft_vocab_size={config.draft_vocab_size}")
        check_draft_ids(draft_ids, base_model.config.vocab_size, config.draft_vocab_size, source=str(folder))
    if (folder / ADAPTER_DIR).is_dir():
        from peft import PeftModel

        base_model = PeftModel.from_pretrained(base_model, str(folder / ADAPTER_DIR)).merge_and_unload().eval()
    heads = (method.family.heads_class or DraftHeads)(
        config, draft_ids=draft_ids if config.draft_vocab_size is not None else None, method=method)
    heads.attach(base_model)  # builds a subclass's own modules (build_parts) so its weights have a place to load into
    missing, unexpected = heads.load_state_dict(state, strict=False)
    if missing or unexpected:  # checked by hand to name the keys: a partial load must never pass silently
        raise ValueError(f"{folder / WEIGHTS_FILE} does not match a {config.family} heads module: "
                         f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    return base_model, heads.to(next(base_model.parameters()).device).eval()
