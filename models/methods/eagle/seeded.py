"""An EAGLE-1 layer without training, for the step-by-step check against the authors' code (docs/conformance.md;
pipelines/conformance_eagle.py).

    eagle = seeded_eagle_module(model, seed=0)
"""
from __future__ import annotations

import torch

from models.methods.eagle.eagle import EagleModule


def seeded_eagle_module(model, seed: int = 0, scale: float = 0.02) -> EagleModule:
    """An EAGLE-1 layer with the same weights on any machine, without training: EagleModule.from_base(model,
    seed) (its decoder layer's Linears N(0, 0.02^2) from that seed), then fc = [N(0, scale^2) | I + N(0, scale^2)]
    with bias N(0, scale^2) from torch.Generator(seed), float32. fc passes the feature f_t on, nearly unchanged,
    and the small random layer adds to it what the token and the context make of it: the predicted feature
    stays near f_t, so the drafts are likely tokens (the root's own runners-up, repeated tokens) and some steps
    accept drafts."""
    module = EagleModule.from_base(model, seed=seed)
    h = model.config.hidden_size
    g = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        weight = torch.randn(h, 2 * h, generator=g, dtype=torch.float32) * scale
        weight[:, h:] += torch.eye(h)
        module.fc.weight.copy_(weight)
        module.fc.bias.copy_(torch.randn(h, generator=g, dtype=torch.float32) * scale)
    return module.eval()
