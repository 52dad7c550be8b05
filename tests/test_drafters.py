"""The drafter protocol: make_drafter builds every kind from a spec, a new drafter is one class and one entry in
make_drafter's table of kinds, and what a step reports comes back in its Draft."""
from __future__ import annotations

import pytest
import torch

from models.base import build_tiny_model
from models.engine.decoding import SamplingConfig, generate
from models.engine.drafting import DRAFTERS, Draft, DraftContext, make_drafter
from models.engine.trees import TreeBuffers, chain_tree
from tests.test_decoding import TREES, prompt_ids, random_heads


class RepeatDrafter:
    """A toy drafter: proposes the root repeated k times (right whenever the answer repeats a token)."""

    def __init__(self, k: int):
        self.buf = TreeBuffers.build(chain_tree(k, name=f"repeat{k}"))

    def start(self, ctx: DraftContext) -> None:
        self.device = ctx.input_ids.device

    def draft(self, root: int, max_depth: int) -> Draft:
        buf = self.buf.to_depth(max_depth)
        return Draft(buf, torch.full((buf.num_tokens,), root, dtype=torch.long, device=self.device))

    def advance(self, hidden, tokens, position) -> None:
        pass

    def rewind(self, position) -> None:
        pass


@pytest.fixture
def toy_kind(monkeypatch):
    monkeypatch.setitem(DRAFTERS, "toy_repeat", lambda spec, **_: RepeatDrafter(int(spec["k"])))
    return "toy_repeat"


def test_a_new_drafter_is_one_class_and_one_entry_and_stays_lossless(toy_kind):
    model, tok = build_tiny_model("llama", seed=0)
    ids = prompt_ids(tok)
    base = generate(model, tok, ids, max_new_tokens=40, stop_token_ids=[])
    res = generate(model, tok, ids, make_drafter({"kind": toy_kind, "k": 3}), max_new_tokens=40, stop_token_ids=[])
    assert res.new_tokens == base.new_tokens and res.steps == len(res.accept_lengths)


def test_make_drafter_names_what_it_knows():
    with pytest.raises(ValueError, match="drafter kind 'eagle3' is not known; accepted: fixed, heads, heads_lookup"):
        make_drafter({"kind": "eagle3"})
    assert make_drafter(None) is None and make_drafter({"kind": "none"}) is None
    with pytest.raises(ValueError, match="needs heads=... and a tree"):
        make_drafter({"kind": "heads", "tree": TREES["chain4"]})


def test_a_draft_carries_node_probabilities_and_extras():
    model, tok = build_tiny_model("llama", seed=0)
    heads = random_heads(model, "hydra")
    hidden = torch.randn(6, model.config.hidden_size)
    ctx = DraftContext(torch.arange(6), hidden, SamplingConfig())
    with torch.inference_mode():
        plain = make_drafter({"kind": "heads", "tree": TREES["sparse64"]}, heads=heads)
        plain.start(ctx)
        assert plain.draft(5, 4).node_probs is None
        probed = make_drafter({"kind": "heads", "tree": TREES["sparse64"], "want_probs": True}, heads=heads)
        probed.start(ctx)
        d = probed.draft(5, 4)
    assert d.node_probs.shape == (d.buf.num_tokens,) and float(d.node_probs[0]) == 1.0
    parents = d.buf.parent.tolist()
    assert all(float(d.node_probs[i]) <= float(d.node_probs[parents[i]]) + 1e-6 for i in range(1, d.buf.num_tokens))
    lookup = make_drafter({"kind": "prompt_lookup", "num_tokens": 4, "max_ngram": 2})
    lookup.start(DraftContext(torch.tensor([1, 2, 3, 1, 2]), hidden[:5], SamplingConfig()))
    d = lookup.draft(3, 4)
    assert d.extras == {"ngram": 2} and d.tokens.tolist() == [3, 1, 2, 3, 1]
