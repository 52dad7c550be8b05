"""DFlash drafters for the conformance checks (make dflash-check) and the tests: one drawn from a seed, and one fitted
to a base's greedy continuations so that its drafts get accepted (the authors' decoding is then compared on the
accepting path too, not only on rejections).

    model, heads = seeded(seed=0, layers=2, block=16)          # an 8-layer tiny Llama and a drafter on it
    model, heads = seeded(0, 2, 8, family="dspark_rnn")        # DSpark: its Markov and confidence heads drawn too
    model, heads = seeded(0, 2, 8, "dspark_rnn", sample_from_anchor=True)   # every slot drafting
    fit_to_greedy(model, heads, sequences, steps=60)           # every block position to the base's greedy token
    fitted = fitted_copy(model, heads, sequences, steps=12)    # the same on a float64 copy, the same on any CPU
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from models.base import build_tiny_model
from models.engine.taps import final_and_taps
from models.methods.dflash import DFLASH, DSPARK, DSPARK_GATED, DSPARK_RNN
from models.shared.draft_heads import HeadsConfig, build_heads

METHODS = {m.name: m for m in (DFLASH, DSPARK, DSPARK_GATED, DSPARK_RNN)}


def seeded(seed: int, layers: int, block: int, family: str = "dflash", sample_from_anchor: bool = False):
    """(base, heads): the tiny base and a DFlash (or DSpark) drafter of blocks of `block` whose every parameter is
    drawn from torch.Generator(seed): norms about 1, matrices scaled by their fan-in; DSpark's Markov embedding at
    unit scale, so that its bias moves the logits. The same parameters either way of sample_from_anchor."""
    model, _ = build_tiny_model("llama", num_layers=8, seed=0)
    config = HeadsConfig.for_base(model, family, num_heads=block - (0 if sample_from_anchor else 1), num_layers=layers,
                                  share_lm_head=True, mask_token_id=model.config.vocab_size - 1,   # the golden files'
                                  sample_from_anchor=sample_from_anchor)
    heads = build_heads(config, METHODS[family], model).eval()
    parts = {"dflash": heads.dflash}
    if getattr(heads, "markov", None) is not None:
        parts.update(markov=heads.markov, confidence=heads.confidence)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted((f"{k}.{n}", p) for k, part in parts.items() for n, p in part.named_parameters()):
            draw = torch.randn(p.shape, generator=g)
            unit = name == "markov.w1.weight"
            p.copy_(draw if unit else 1 + 0.1 * draw if p.dim() == 1 else draw / p.shape[-1] ** 0.5)
    return model, heads


def fit_to_greedy(model, heads, sequences: list[list[int]], steps: int, lr: float = 3e-3, depths: int | None = None):
    """Adam on the drafter alone: at every position of each sequence, the slot drafting depth k + 1
    (DFlashModule.unroll) to the base's greedy token k + 1 below the root, unweighted cross-entropy; the heads are
    left in eval mode."""
    module, h = heads.dflash, model.config.hidden_size
    depths = depths or module.depths
    data = []
    with torch.no_grad():
        for s in sequences:
            ids = torch.tensor(s)[None]
            both = final_and_taps(model.get_decoder(), ids, module.taps, position_ids=torch.arange(len(s))[None])
            data.append((ids, both[..., h:], model.get_output_embeddings()(both[..., :h])[0].argmax(-1)))
    opt = torch.optim.Adam(module.parameters(), lr=lr)
    module.train()
    for _ in range(steps):
        loss = 0.0
        for ids, feats, greedy in data:
            T = ids.shape[1]
            for k, d in enumerate(module.unroll(feats, ids, depths)):      # row r scores x_{r+k+2} = greedy[r+k+1]
                r = torch.arange(max(T - 2 - k, 0))
                if r.numel():
                    loss = loss + F.cross_entropy(heads.lm_head(0, d[0, r]), greedy[r + k + 1])
        opt.zero_grad()
        loss.backward()
        opt.step()
    heads.eval()
    return heads


def fitted_copy(model, heads, sequences: list[list[int]], steps: int):
    """A float32 copy of `heads` fitted by fit_to_greedy in float64 (base and drafter), so that it comes out the same
    on every CPU: in float32 the kernels' summation order differs between AVX2 and AVX-512 machines, and Adam turns
    a gradient that is rounding noise into a whole step (so the golden file's trained case replays anywhere)."""
    wide = copy.deepcopy(model).double()
    fitted = copy.deepcopy(heads).double()
    fitted.attach(wide)          # its LM head; the embedding's rows are exact in either width
    torch.manual_seed(0)
    fit_to_greedy(wide, fitted, sequences, steps)
    return fitted.float().attach(model)
