"""What EAGLE's layer and a small draft model share: decoder layers of the base's class run over (feature, next
token) pairs with their own KV cache, scored by the frozen base LM head (docs/reference.md#autoregressive-drafters).

    pred = module(features, next_tokens, position_ids, cache=cache)   # [B, T, h], [B, T], [B, T] -> [B, T, h]
    preds = module.unroll(hidden, input_ids, depths=4)                # every position's chain along the true path
    logits = module.logits(pred)                                      # [..., h] -> [..., V]: the base LM head

Row t is the pair (f_t, x_{t+1}): the base's final hidden state at t and the token after it, at position t.
Its output is the predicted f_{t+1}, whose LM head scores x_{t+2}. A subclass says how a pair becomes the first
layer's input (`inputs`: EAGLE fuses both, a draft model embeds the token alone) and holds `layers` (and an
optional final `norm`). The base's embedding, LM head and rotary embedding (unless `rotary` is overridden) are
referenced, frozen and never saved. Not handled: architectures that scale their embeddings inside the model
(Gemma) get the unscaled embedding.
"""
from __future__ import annotations

import abc

import torch
from torch import nn
from transformers import DynamicCache

from models.engine.kv_cache import cache_kwargs


def reinit_linears(module: nn.Module, std: float) -> None:
    """Every Linear under `module` re-initialised as the base model initialises its own: normal(0, std) weights,
    zero biases (the draft layer copied from the base starts untrained)."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, std)
                if m.bias is not None:
                    m.bias.zero_()


class AutoregressiveDraft(nn.Module, abc.ABC):
    """Subclasses set self.layers (nn.ModuleList of decoder layers, layer_idx 0..n-1 of their own cache), optionally
    self.norm, and implement inputs(). `taps` names the base states the module reads as features
    (models/engine/taps.py; empty: the final hidden state); `readout` is what the LM head reads of a prediction."""

    taps: tuple[int, ...] = ()

    def __init__(self, base_model):
        super().__init__()
        self.base_config = base_model.config
        self._base = {"embed": base_model.get_input_embeddings(), "lm_head": base_model.get_output_embeddings(),
                      "rotary": getattr(base_model.get_decoder(), "rotary_emb", None)}

    # -- the base's parts ----------------------------------------------------------------------
    @property
    def lm_head(self) -> nn.Module:
        """The frozen base LM head ([..., h] -> [..., V])."""
        return self._base["lm_head"]

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The frozen base embedding: [...] token ids -> [..., h] in the module's dtype."""
        with torch.no_grad():
            return self._base["embed"](tokens).to(self.dtype)

    def rotary(self, x: torch.Tensor, position_ids: torch.Tensor):
        """(cos, sin) at position_ids [B, T] for the layers' attention: the base's rotary embedding, whose layers
        these are (EAGLE-3's Llama layer has its own)."""
        return self._base["rotary"](x, position_ids)

    # -- computation ---------------------------------------------------------------------------
    @abc.abstractmethod
    def inputs(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """The first layer's input [B, T, h] from the pairs: features [B, T, h], next_tokens [B, T]."""

    def forward(self, features: torch.Tensor, next_tokens: torch.Tensor, position_ids: torch.Tensor, cache=None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted next features [B, T, h] from features f_t [B, T, h] and tokens x_{t+1} [B, T] at positions
        position_ids [B, T] (those of f_t).

        cache: a transformers Cache whose layers hold earlier positions (each grows by T rows); attention_mask:
        an additive [B, 1, T, past + T] mask over the cached rows and these (None: causal, everything cached
        visible)."""
        B, T, _ = features.shape
        past = cache.get_seq_length() if cache is not None else 0
        x = self.inputs(features, next_tokens)                                              # [B, T, h]
        if attention_mask is None:
            causal = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)  # [T, past + T]
            attention_mask = torch.zeros(B, 1, T, past + T, dtype=x.dtype, device=x.device)
            attention_mask.masked_fill_(~causal, torch.finfo(x.dtype).min)
        pos_emb = self.rotary(x, position_ids)                                              # (cos, sin)
        for layer in self.layers:
            out = layer(x, attention_mask=attention_mask.to(x.dtype), position_ids=position_ids,
                        use_cache=cache is not None, position_embeddings=pos_emb, **cache_kwargs(layer, cache))
            x = out[0] if isinstance(out, tuple) else out                                   # [B, T, h]
        norm = getattr(self, "norm", None)                  # a submodule when the subclass has one
        return x if norm is None else norm(x)

    def unroll(self, hidden: torch.Tensor, input_ids: torch.Tensor, depths: int,
               noise: float | torch.Tensor = 0.0) -> list[torch.Tensor]:
        """The drafts of every position of whole sequences along their true tokens, depth by depth, as the drafter
        runs them when its parents are right (training, validation and calibration).

        hidden [B, T, w]: the base's features f_0..f_{T-1} (final states, or the taps the module names);
        input_ids [B, T]; right padding. -> `depths` tensors
        [B, T-1, h]: entry k at row r is the feature predicted k+1 steps after the root pair (f_r, x_{r+1}),
        whose LM head scores x_{r+k+2} (row r of entry k is "head k at position r"). Depth 0 is one causal pass
        over the pairs (f_t, x_{t+1}); depth k >= 1 runs the pairs (entry k-1 at r, x_{r+k+1}) at positions r+k,
        each seeing the true pairs up to r and its own chain above it (the draft cache's view in decoding).
        noise: uniform noise of this width added to the true features (EAGLE's training augmentation); a
        tensor [B] gives each row its own width."""
        B, T, _ = hidden.shape
        feats = hidden[:, :-1].to(self.dtype)                                       # [B, T-1, h]
        if torch.is_tensor(noise):
            noise = noise.to(feats.device, feats.dtype).view(B, 1, 1)
        if torch.is_tensor(noise) or noise:
            feats = feats + (torch.rand_like(feats) - 0.5) * noise
        pos = torch.arange(T - 1, device=hidden.device).expand(B, -1)               # [B, T-1]
        tokens = torch.cat([input_ids, input_ids.new_zeros(B, depths)], dim=1)      # x_{r+k+1} past the end: 0
        cache = DynamicCache()
        preds = [self(feats, input_ids[:, 1:], pos, cache=cache)]                   # [B, T-1, h]
        n = T - 1
        causal = torch.ones(n, n, dtype=torch.bool, device=hidden.device).tril()   # true pairs up to r
        own = torch.eye(n, dtype=torch.bool, device=hidden.device)                 # the chain rows of root r
        for k in range(1, depths):
            visible = torch.cat([causal, *[own] * k], dim=-1)                       # [n, n * (k + 1)]
            mask = torch.zeros(B, 1, n, n * (k + 1), dtype=self.dtype, device=hidden.device)
            mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
            preds.append(self(preds[-1], tokens[:, k + 1:k + T], pos + k, cache=cache, attention_mask=mask))
        return preds

    def readout(self, pred: torch.Tensor) -> torch.Tensor:
        """What the LM head reads of a predicted feature [..., h] (EAGLE-3: its final norm); the feature itself
        is what the next depth reads."""
        return pred

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """The base LM head over (predicted) features: [..., h] -> [..., V] (without the model's logit
        transform, if it has one: projection.BaseLogits adds it)."""
        head = self.lm_head
        return head(self.readout(features).to(head.weight.dtype))
