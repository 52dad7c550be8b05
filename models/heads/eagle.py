"""EAGLE-1's draft module: one decoder layer that predicts the base model's next feature (docs/reference.md#autoregressive-drafters).

    eagle = EagleModule.from_base(model, seed=0)                  # fc + one decoder layer of the base's architecture
    pred = eagle(features, next_tokens, position_ids, cache=cache)  # [B, T, h], [B, T], [B, T] -> [B, T, h]
    preds = eagle.unroll(hidden, input_ids, depths=4)             # every position's chain along the true path
    logits = eagle.logits(pred)                                   # [B, T, h] -> [B, T, V]: the base LM head
    drafter = make_drafter({"kind": "eagle", "tree": spec}, eagle=eagle)    # models/engine/drafters/eagle.py

At position t EAGLE reads f_t, the base's final hidden state (after its final norm: transformers'
last_hidden_state), and x_{t+1}, the token after it, embedded by the frozen base embedding:

    x    = fc(cat([embed(x_{t+1}) ; f_t]))      [B, T, 2h] -> [B, T, h]    Linear with bias
    pred = layer(x)                             [B, T, h] -> [B, T, h]     one decoder layer of the base's class,
                                                                           its input norm removed, no final norm
pred is the predicted f_{t+1}; the base LM head over it scores x_{t+2}. Like eagle-llm 1.2.1's cnets.py
(embedding first, then feature; the only layer skips input_layernorm) at the position t of f_t.

The layer is a copy of the base's last decoder layer with every Linear re-initialised (normal, the base
config's initializer_range, zero biases; the norms are the base's); fc has torch's default init. The base's
embedding, LM head and rotary embedding are referenced, frozen and never saved: state_dict() holds fc and the
layer only. The module computes in float32 whatever the base's dtype. Not handled: architectures that scale
their embeddings inside the model (Gemma) get the unscaled embedding.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import DynamicCache


class EagleModule(nn.Module):
    """fc (2h -> h, bias) and one decoder layer (layer index 0 of its own KV cache); base parts by reference."""

    def __init__(self, fc: nn.Linear, layer: nn.Module, base_model):
        super().__init__()
        self.fc, self.layer = fc, layer
        self.base_config = base_model.config
        self._base = {"embed": base_model.get_input_embeddings(), "lm_head": base_model.get_output_embeddings(),
                      "rotary": getattr(base_model.get_decoder(), "rotary_emb", None)}

    @classmethod
    def from_base(cls, base_model, seed: int | None = None) -> "EagleModule":
        """A fresh (untrained) module for `base_model`: a re-initialised copy of its last decoder layer without
        the input norm, and fc; `seed` makes the initial weights reproducible (None: torch's global RNG)."""
        decoder = base_model.get_decoder()
        h = base_model.config.hidden_size
        std = float(getattr(base_model.config, "initializer_range", 0.02))
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            fc = nn.Linear(2 * h, h, bias=True)
            layer = copy.deepcopy(decoder.layers[-1]).to(device="cpu", dtype=torch.float32)
            layer.self_attn.layer_idx = 0                     # the only layer of its own cache
            layer.input_layernorm = nn.Identity()             # EAGLE-1: no input norm (its input is fc's output)
            with torch.no_grad():
                for module in layer.modules():
                    if isinstance(module, nn.Linear):
                        module.weight.normal_(0.0, std)
                        if module.bias is not None:
                            module.bias.zero_()
        device = base_model.get_output_embeddings().weight.device
        return cls(fc, layer, base_model).to(device=device, dtype=torch.float32).train(False)

    # -- the base's parts ----------------------------------------------------------------------
    @property
    def lm_head(self) -> nn.Module:
        """The frozen base LM head ([..., h] -> [..., V])."""
        return self._base["lm_head"]

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The frozen base embedding: [...] token ids -> [..., h] in the module's dtype."""
        with torch.no_grad():
            return self._base["embed"](tokens).to(self.dtype)

    # -- computation ---------------------------------------------------------------------------
    def forward(self, features: torch.Tensor, next_tokens: torch.Tensor, position_ids: torch.Tensor, cache=None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted next features [B, T, h] from features f_t [B, T, h] and tokens x_{t+1} [B, T] at positions
        position_ids [B, T] (those of f_t).

        cache: a transformers Cache whose layer 0 holds earlier positions (grows by T rows); attention_mask:
        an additive [B, 1, T, past + T] mask over the cached rows and these (None: causal, everything cached
        visible)."""
        B, T, _ = features.shape
        past = cache.get_seq_length() if cache is not None else 0
        x = self.fc(torch.cat([self.embed(next_tokens), features.to(self.dtype)], dim=-1))  # [B, T, 2h] -> [B, T, h]
        if attention_mask is None:
            causal = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)  # [T, past + T]
            attention_mask = torch.zeros(B, 1, T, past + T, dtype=x.dtype, device=x.device)
            attention_mask.masked_fill_(~causal, torch.finfo(x.dtype).min)
        pos_emb = self._base["rotary"](x, position_ids)                                     # (cos, sin)
        out = self.layer(x, attention_mask=attention_mask.to(x.dtype), position_ids=position_ids,
                         past_key_values=cache, use_cache=cache is not None, position_embeddings=pos_emb)
        return out[0] if isinstance(out, tuple) else out                                    # [B, T, h]

    def unroll(self, hidden: torch.Tensor, input_ids: torch.Tensor, depths: int, noise: float = 0.0) -> list[torch.Tensor]:
        """The drafts of every position of whole sequences along their true tokens, depth by depth, as the drafter
        runs them when its parents are right (training, validation and calibration).

        hidden [B, T, h]: the base's features f_0..f_{T-1}; input_ids [B, T]; right padding. -> `depths` tensors
        [B, T-1, h]: entry k at row r is the feature predicted k+1 steps after the root pair (f_r, x_{r+1}),
        whose LM head scores x_{r+k+2} (row r of entry k is "head k at position r"). Depth 0 is one causal pass
        over the pairs (f_t, x_{t+1}); depth k >= 1 runs the pairs (entry k-1 at r, x_{r+k+1}) at positions r+k,
        each seeing the true pairs up to r and its own chain above it (the draft cache's view in decoding).
        noise: uniform noise of this width added to the true features (EAGLE's training augmentation)."""
        B, T, _ = hidden.shape
        feats = hidden[:, :-1].to(self.dtype)                                       # [B, T-1, h]
        if noise:
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

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """The base LM head over (predicted) features: [..., h] -> [..., V] (without the model's logit
        transform, if it has one: projection.BaseLogits adds it)."""
        head = self.lm_head
        return head(features.to(head.weight.dtype))
