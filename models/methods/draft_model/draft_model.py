"""A small draft model for speculative decoding (Leviathan et al. 2023; docs/reference.md#autoregressive-drafters):
a few decoder layers of the base's width over the tokens alone, its own KV cache, the base LM head.

    draft = DraftModel.from_base(model, num_layers=2)     # copies of base layers 0 and L-1 and the final norm

It is an AutoregressiveDraft (models/shared/autoregressive/draft.py) that ignores the features: the pair (f_t, x_{t+1})
at position t becomes embed(x_{t+1}), so its output at row t scores x_{t+2} as a causal LM's would (every position
is one lower than the base's; rotary attention sees only differences). Drafting, training by distillation
(soft cross-entropy to the base's distribution), calibration and decoding are EAGLE's code paths. The layers are
copies of `num_layers` base layers spread over the depth (the first and the last for 2) with their weights,
so the untrained draft model is the base cut short; the final norm is the base's. float32.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from models.shared.autoregressive.draft import AutoregressiveDraft


def spread_layers(total: int, n: int) -> list[int]:
    """n layer indices spread over 0..total-1, first and last included (n = 1: the last)."""
    if not 1 <= n <= total:
        raise ValueError(f"a draft model takes 1 to {total} of the base's layers, not {n}")
    return [total - 1] if n == 1 else [round(i * (total - 1) / (n - 1)) for i in range(n)]


class DraftModel(AutoregressiveDraft):
    def __init__(self, layers: nn.ModuleList, norm: nn.Module, base_model):
        super().__init__(base_model)
        self.layers, self.norm = layers, norm
        self.source_layers = spread_layers(base_model.config.num_hidden_layers, len(layers))   # base layers copied

    @classmethod
    def from_base(cls, base_model, num_layers: int = 2) -> "DraftModel":
        decoder = base_model.get_decoder()
        layers = nn.ModuleList()
        for i, index in enumerate(spread_layers(len(decoder.layers), num_layers)):
            layer = copy.deepcopy(decoder.layers[index]).to(device="cpu", dtype=torch.float32)
            layer.self_attn.layer_idx = i                     # its place in the draft model's own cache
            layers.append(layer)
        norm = copy.deepcopy(decoder.norm).to(device="cpu", dtype=torch.float32)
        device = base_model.get_output_embeddings().weight.device
        return cls(layers, norm, base_model).to(device=device).train(False)

    def inputs(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(next_tokens)                                   # [B, T, h]: the features are not read

    def to_causal_lm(self, base_model):
        """A transformers model of the base's class made of these layers and norm, the base's embedding and LM head
        (shared, not copied), in the base's dtype: the assistant of transformers' assisted generation (sps_hf). It
        reads every token at its own position (x_0 too), so its drafts can differ slightly from this module's."""
        config = copy.deepcopy(base_model.config)
        config.num_hidden_layers = len(self.layers)
        if getattr(config, "layer_types", None):                         # per-layer attention kinds (Qwen2, Gemma-2)
            config.layer_types = [config.layer_types[i] for i in self.source_layers]
        lm = type(base_model)(config)
        decoder = lm.get_decoder()
        for mine, theirs in zip(self.layers, decoder.layers, strict=True):
            theirs.load_state_dict(mine.state_dict())
        decoder.norm.load_state_dict(self.norm.state_dict())
        lm.set_input_embeddings(base_model.get_input_embeddings())
        lm.set_output_embeddings(base_model.get_output_embeddings())
        lm.generation_config = copy.deepcopy(base_model.generation_config)
        device = base_model.get_output_embeddings().weight.device
        return lm.to(device=device, dtype=base_model.get_output_embeddings().weight.dtype).eval()
