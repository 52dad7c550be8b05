"""DFlash's draft module (z-lab's block-diffusion drafter, docs/reference.md): a few decoder layers that draft a whole
block of tokens in one forward. The block is the last verified token followed by mask tokens; every draft layer's
keys and values are the base's features of the accepted positions (the "context", fused from several of the base's
layers) followed by the block's own, and the block attends to all of them and to itself both ways (no causal mask).

    module = DFlashModule.from_base(model, num_layers=2, block_size=16, seed=0)
    module.taps                               # the base states it reads (models/engine/taps.py indices)
    out = module(features, block_ids, position_ids, cache=cache)   # [B, C, w], [B, Q], [B, C + Q] -> [B, Q, h]
    drafts = module.unroll(features, input_ids, depths=15)         # a block at every position (calibration)

Per layer, with x the block's hidden states [Q, h] and c = hidden_norm(fc(features)) the context [C, h]:

    q = q_norm(q_proj(input_layernorm(x)))                              per head, rotary at the block's positions
    k = k_norm(k_proj([c ; input_layernorm(x)])),  v = v_proj([c ; input_layernorm(x)])   rotary at [ctx ; block]
    x = x + o_proj(attention(q, cached k, v ; k, v)),  x = x + mlp(post_attention_layernorm(x))

and the output is norm(x); block position i >= 1 scores the token at that position through the base's LM head (with
sample_from_anchor, position i the token at i + 1, slot 0 drafting too: first_slot).
The context is not normed by the layer's own input norm, as in the authors' Qwen3-style layers (dflash 0.1.0,
dflash/model.py Qwen3DFlashAttention). The layers are Llama-sized from the base (models/shared/layer_config.py) with
the authors' per-head q/k norms; their Linears are initialised normal(0, the base's initializer_range), every norm at
one. A draft cache keeps the context's keys and values from one draft to the next (DFlashCache); the block's are
cropped off after each draft. float32.

The mask token is the drafter's own by default: id vocab_size, one past the base's vocabulary, embedded by a learned
`mask_embedding` that starts at the mean of the base's embedding rows (where transformers starts a token added to a
vocabulary), so that no real token of the base stands for "not drafted yet". Given an id of the base's vocabulary
(heads.mask_token_id), the mask takes that token's frozen row, as the authors' and the serving engines' checkpoints
do (their formats embed the mask with the base's table: check_base_mask).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, rotate_half

from models.shared.layer_config import layer_config


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The base layers whose outputs the context fuses, as the authors pick them: one per draft layer, spread from
    layer 1 to layer L - 3 (one draft layer: the middle one)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def dflash_taps(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The taps (hidden_states indices: layer id + 1) of build_target_layer_ids, clamped to the layer outputs 1..L
    for the tiny test bases whose L - 3 is below 1."""
    ids = build_target_layer_ids(num_target_layers, num_draft_layers)
    return tuple(min(max(i + 1, 1), num_target_layers) for i in ids)


@dataclass(frozen=True)
class BlockLayout:
    """Training's blocks as block_mask lays them out, for block_attention: anchors [B, N], keep [B, N], T context
    positions, blocks of `block`."""
    anchors: torch.Tensor
    keep: torch.Tensor
    T: int
    block: int

    def context_visible(self) -> torch.Tensor:
        """[B, 1, N, block, T] bool: a block's queries see the context before its anchor (when kept)."""
        ctx = torch.arange(self.T, device=self.anchors.device)
        seen = (ctx < self.anchors[..., None]) & self.keep[..., None]                             # [B, N, T]
        return seen[:, None, :, None, :].expand(-1, -1, -1, self.block, -1)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """The attention block_mask describes, without its dense [Q, T + Q] scores: each block's queries against the
    context (before its anchor) and against its own block, one softmax over both. q [B, H, N * block, d], k and v
    [B, KV, T + N * block, d] (context, then the blocks) -> [B, H, N * block, d]. The same sums as SDPA under
    block_mask (within float rounding), at a fraction of the products: a block sees T + block keys, not T + Q."""
    B, H, Q, d = q.shape
    KV, T, bs = k.shape[1], layout.T, layout.block
    N, rep = Q // bs, H // KV
    qg = q.reshape(B, KV, rep * Q, d) * d ** -0.5                # a KV head's query heads as rows: no copy of K
    kc, vc = k[:, :, :T], v[:, :, :T]                                                        # [B, KV, T, d]
    s_ctx = (qg @ kc.transpose(-1, -2)).view(B, KV, rep, N, bs, T)
    s_ctx = s_ctx.masked_fill(~layout.context_visible()[:, :, None], float("-inf"))
    qb = qg.view(B, KV, rep, N, bs, d)
    kb = k[:, :, None, T:].reshape(B, KV, 1, N, bs, d)
    vb = v[:, :, None, T:].reshape(B, KV, 1, N, bs, d)
    s_own = qb @ kb.transpose(-1, -2)                                                        # [B, KV, rep, N, bs, bs]
    p = torch.cat([s_ctx, s_own], -1).softmax(-1)
    out = (p[..., :T].reshape(B, KV, rep * Q, T) @ vc).view(B, KV, rep, N, bs, d) + p[..., T:] @ vb
    return out.reshape(B, H, Q, d)


def block_mask(anchors: torch.Tensor, keep: torch.Tensor, T: int, block: int) -> torch.Tensor:
    """[B, 1, N * block, T + N * block] bool: a block's queries see the context before its anchor (when kept) and
    their own block."""
    B, N = anchors.shape
    q_block = torch.arange(N * block, device=anchors.device) // block                      # [Q]
    kv = torch.arange(T + N * block, device=anchors.device)
    anchor_q = anchors[:, q_block]                                                          # [B, Q]
    context = (kv[None, None] < T) & (kv[None, None] < anchor_q[..., None]) & keep[:, q_block][..., None]
    own = (kv[None, None] >= T) & ((kv[None, None] - T) // block == q_block[None, :, None])
    return (context | own)[:, None]


class DFlashCache:
    """Each layer's keys and values [B, kv_heads, S, d] of the positions drafted against (the context), in order."""

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def extend(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[i] is not None:
            k, v = torch.cat([self.k[i], k], dim=2), torch.cat([self.v[i], v], dim=2)
        self.k[i], self.v[i] = k, v
        return k, v

    def crop(self, n: int) -> None:
        """Keep the first n positions."""
        self.k = [None if k is None else k[:, :, :n] for k in self.k]
        self.v = [None if v is None else v[:, :, :n] for v in self.v]


class DFlashLayer(nn.Module):
    """One draft layer (module docstring): attention over [context ; block] keys and values, SwiGLU MLP."""

    def __init__(self, config):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.q_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x, ctx, cos, sin, cache: DFlashCache | None = None, index: int = 0, mask=None):
        """x [B, Q, h] the block, ctx [B, C, h] the new context rows, cos/sin [B, C + Q, d] at their positions;
        mask: an additive or bool [B, 1, Q, S] mask over every key (None: all visible), or a BlockLayout."""
        B, Q, _ = x.shape
        xn = self.input_layernorm(x)
        both = torch.cat([ctx, xn], dim=1)                                                  # [B, C + Q, h]
        q = self.q_norm(self.q_proj(xn).view(B, Q, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(both).view(B, -1, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(both).view(B, -1, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos[:, :, -Q:] + rotate_half(q) * sin[:, :, -Q:]
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.extend(index, k, v)
        if isinstance(mask, BlockLayout):            # training's blocks: each against its context and itself only
            out = block_attention(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads)
        x = x + self.o_proj(out.transpose(1, 2).reshape(B, Q, -1))
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashModule(nn.Module):
    """fc (len(taps) * h -> h, no bias) and hidden_norm over the base's tapped features, the draft layers, the final
    norm, a Llama rotary embedding of the base's settings; the base's embedding by reference (frozen, not saved)."""

    def __init__(self, base_model, num_layers: int, block_size: int = 16, mask_token_id: int | None = None,
                 sample_from_anchor: bool = False):
        super().__init__()
        if num_layers < 1 or block_size < 2:
            raise ValueError(f"a DFlash drafter needs at least 1 layer and a block of 2 or more tokens; got "
                             f"num_layers={num_layers}, block_size={block_size}")
        config = layer_config(base_model.config)
        h = config.hidden_size
        self.base_config, self.block_size = base_model.config, int(block_size)
        V = self.vocab_size = int(base_model.config.vocab_size)
        if mask_token_id is not None and not 0 <= int(mask_token_id) < V:
            raise ValueError(f"heads.mask_token_id={mask_token_id!r} is not accepted; it takes null (the drafter's "
                             f"own mask token, id {V}) or an id of the base's vocabulary, 0 to {V - 1}")
        self.mask_token_id = V if mask_token_id is None else int(mask_token_id)
        self.sample_from_anchor = bool(sample_from_anchor)
        L = base_model.config.num_hidden_layers
        self.target_layer_ids = build_target_layer_ids(L, num_layers)
        self.taps = dflash_taps(L, num_layers)
        self.fc = nn.Linear(len(self.taps) * h, h, bias=False)
        self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(config) for _ in range(num_layers)])
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)              # buffers only, not saved
        self._base = {"embed": base_model.get_input_embeddings()}
        std = float(getattr(base_model.config, "initializer_range", 0.02))
        with torch.no_grad():                                         # the authors' initialisation, stated
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    m.weight.normal_(0.0, std)
                elif isinstance(m, LlamaRMSNorm):
                    m.weight.fill_(1.0)
        table = base_model.get_input_embeddings().weight
        self.mask_embedding = None if mask_token_id is not None else \
            nn.Parameter(table.detach().float().mean(0).to(table.device))             # [h], the own token's row

    @classmethod
    def from_base(cls, base_model, num_layers: int, block_size: int = 16, mask_token_id: int | None = None,
                  seed: int | None = None, sample_from_anchor: bool = False) -> "DFlashModule":
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            module = cls(base_model, num_layers, block_size, mask_token_id, sample_from_anchor)
        device = base_model.get_input_embeddings().weight.device
        return module.to(device=device, dtype=torch.float32).train(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def first_slot(self) -> int:
        """The block slot that drafts the token after the root: 1 (slot k drafts the token k after the anchor, the
        authors' alignment), or 0 with sample_from_anchor (slot k the token k + 1 after it, the speculators library's
        DSpark default: every slot drafts)."""
        return 0 if self.sample_from_anchor else 1

    @property
    def depths(self) -> int:
        """How deep a block drafts: its slots from first_slot on."""
        return self.block_size - self.first_slot

    @property
    def own_mask(self) -> bool:
        """Whether the mask is the drafter's own token (id vocab_size, mask_embedding), not a row of the base."""
        return self.mask_embedding is not None

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The base's frozen rows; the own mask token (id vocab_size) its learned mask_embedding."""
        own = tokens == self.vocab_size if self.own_mask else None
        with torch.no_grad():
            x = self._base["embed"](tokens if own is None else tokens.masked_fill(own, 0)).to(self.dtype)
        return x if own is None else torch.where(own[..., None], self.mask_embedding.to(x.dtype), x)

    def new_cache(self) -> DFlashCache:
        return DFlashCache(len(self.layers))

    def forward(self, features: torch.Tensor, block_ids: torch.Tensor, position_ids: torch.Tensor,
                cache: DFlashCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """features [B, C, len(taps) * h] of the new context positions, block_ids [B, Q], position_ids [B, C + Q]
        (the context's, then the block's) -> the block's outputs [B, Q, h] (module docstring)."""
        ctx = self.hidden_norm(self.fc(features.to(self.dtype)))                          # [B, C, h]
        x = self.embed(block_ids)                                                         # [B, Q, h]
        cos, sin = self.rotary_emb(x, position_ids)                                       # [B, C + Q, d]
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, cos.to(x.dtype), sin.to(x.dtype), cache, i, mask)
        return self.norm(x)

    def unroll(self, features: torch.Tensor, input_ids: torch.Tensor, depths: int, chunk: int = 32,
               with_anchor: bool = False) -> list[torch.Tensor]:
        """The drafts of every position of whole sequences, as decoding drafts them there (calibration's ranks; the
        autoregressive modules' unroll has the same layout). features [B, T, w] of positions 0..T-1, input_ids
        [B, T] -> `depths` tensors [B, T-1, h]: entry k at row r is the slot drafting depth k + 1 (first_slot + k)
        of the whole block rooted at x_{r+1} over the context 0..r, which scores x_{r+k+2}. The blocks run `chunk`
        at a time, each seeing its own context only (block_mask). with_anchor: every slot from slot 0 (the root's)
        to the deepest drafting one, first_slot + depths entries."""
        B, T, _ = features.shape
        bs = self.block_size
        if not 1 <= depths <= self.depths:
            raise ValueError(f"a DFlash block of {bs} tokens drafts 1 to {self.depths} deep, not {depths}")
        first = 0 if with_anchor else self.first_slot                                     # the first slot kept
        out = [features.new_zeros(B, T - 1, self.norm.weight.shape[0], dtype=self.dtype)
               for _ in range(depths + self.first_slot - first)]
        steps = torch.arange(bs, device=features.device)
        for c in range(0, T - 1, chunk):
            rows = torch.arange(c, min(c + chunk, T - 1), device=features.device)        # [N]
            anchors = (rows + 1).expand(B, -1)                                            # [B, N]: the roots
            N = rows.numel()
            block = torch.full((B, N, bs), self.mask_token_id, dtype=torch.long, device=features.device)
            block[..., 0] = input_ids[:, rows + 1]
            pos = torch.cat([torch.arange(T, device=features.device).expand(B, T),
                             (anchors[..., None] + steps).view(B, -1)], dim=1)
            mask = block_mask(anchors, torch.ones_like(anchors, dtype=torch.bool), T, bs)
            drafted = self(features, block.view(B, -1), pos, mask=mask).view(B, N, bs, -1)
            for k in range(len(out)):
                out[k][:, rows] = drafted[:, :, k + first]
        return out

    def readout(self, pred: torch.Tensor) -> torch.Tensor:
        """What the LM head reads of a drafted position: its output as it is (the final norm is in forward)."""
        return pred
