"""A tiny EAGLE-3 draft from a seed and its logits, as `make interop` hands it to the speculators library and
tests/test_speculators_format.py replays it (docs/conformance.md#speculators-interop).

    model, _ = interop_base()                           # an 8-layer tiny Llama: three distinct taps (2, 4, 5)
    heads = seeded_eagle3_heads(model, seed=0)          # every parameter drawn from torch.Generator(seed)
    inputs = draft_inputs(model, heads, seed=0)         # the base's taps on seeded tokens
    logits = draft_logits(heads, inputs)                # [T-1, Vd]: depth 0 over the draft vocabulary

Every parameter of the heads is overwritten after they are built, in sorted name order, so the draft does not
depend on how the module is initialised or constructed, only on its parameter names and shapes.
"""
from __future__ import annotations

import torch

from models.base import build_tiny_model
from models.methods.eagle import EAGLE3
from models.shared.draft_heads import DraftHeads, HeadsConfig, build_heads

BASE = {"arch": "llama", "num_layers": 8, "seed": 0}       # fewer than 7 layers repeat a tap (models/engine/taps.py)
DRAFT_VOCAB, DEPTHS, TOKENS = 48, 3, 9


def interop_base():
    """(model, tokenizer): the tiny base the interop draft sits on."""
    return build_tiny_model(BASE["arch"], num_layers=BASE["num_layers"], seed=BASE["seed"])


def seeded_eagle3_heads(model, seed: int = 0) -> DraftHeads:
    """eagle3 heads over a draft vocabulary of DRAFT_VOCAB random ids, own LM head; then, parameter by parameter
    in sorted name order, from torch.Generator(seed): vectors (the norms) 1 + N(0, 0.1^2), matrices
    N(0, 1 / fan_in), so logits spread enough for a clear argmax."""
    g = torch.Generator().manual_seed(int(seed))
    ids = torch.randperm(model.config.vocab_size, generator=g)[:DRAFT_VOCAB]
    config = HeadsConfig.for_base(model, EAGLE3.name, num_heads=DEPTHS, share_lm_head=False,
                                  draft_vocab_size=DRAFT_VOCAB)
    heads = build_heads(config, EAGLE3, model, ids)
    with torch.no_grad():
        for _, p in sorted(heads.named_parameters()):
            draw = torch.randn(p.shape, generator=g, dtype=torch.float32)
            p.copy_(1 + 0.1 * draw if p.dim() == 1 else draw / p.shape[-1] ** 0.5)
    return heads.eval()


@torch.no_grad()
def draft_inputs(model, heads: DraftHeads, seed: int = 0) -> dict:
    """TOKENS seeded token ids and what depth 0 reads of them: the base's taps at 0..T-2 (concatenated, [T-1, 3h]),
    the tokens after them and their positions."""
    g = torch.Generator().manual_seed(int(seed) + 1)
    ids = torch.randint(3, model.config.vocab_size, (1, TOKENS), generator=g)
    hidden = model(ids, output_hidden_states=True).hidden_states
    taps = heads.draft_module.taps
    features = torch.cat([hidden[i][0, :-1] for i in taps], dim=-1).float()
    return {"input_ids": ids[0].tolist(), "hidden_states": features, "next_tokens": ids[0, 1:],
            "position_ids": torch.arange(TOKENS - 1)}


@torch.no_grad()
def draft_logits(heads: DraftHeads, inputs: dict) -> torch.Tensor:
    """Depth 0 at every row: logits [T-1, Vd] over the draft vocabulary from (taps, next token) pairs."""
    module = heads.draft_module
    pred = module(inputs["hidden_states"][None], inputs["next_tokens"][None], inputs["position_ids"][None])
    return heads.lm_head(0, module.readout(pred))[0].float()
