"""pytest tests/test_sampling_ar.py: speculative sampling stays lossless with the autoregressive drafters.

EAGLE heads (family eagle, a draft vocabulary), a bare EagleModule (kind eagle, the base LM head over the full
vocabulary), EAGLE-3 heads (family eagle3: the base's taps, its own final norm and LM head) and a small draft model
(family draft_model) draft through models/shared/autoregressive/proposer.py, and DFlash (a block in one forward)
through its own proposer. As in
tests/test_sampling.py (its helpers), the first three generated tokens under top_k=3 (27 outcomes), the first
step drafting and verifying a depth-2 tree, are compared with the exact distribution computed from the base
model's own logits by a chi-square test, for children drawn from the draft's own q (draft="sample") and for its
top-k ranks (draft="topk"). The drafts are made close to the base but perturbed, so that every run sees drafts
accepted at depth 1 and 2 and rejected; a uniform q handed to the rule in place of the draft's must fail it.
Typical acceptance (not lossless by design) runs and repeats itself under a seed.
"""
from __future__ import annotations

import copy

import pytest
import torch

from models.engine.acceptance import SamplingConfig
from models.engine.decoding import generate
from models.engine.drafting import TreeDrafter, heads_drafter
from models.methods.eagle.drafter import EagleDrafter
from models.shared import HeadsConfig
from models.methods import build_heads
from models.shared.draft_vocab import most_frequent
from tests.test_sampling import MAX_NEW, TOKENS, TOP_K, TREE, chi2_pvalue, first_tokens_distribution, make_setup

pytestmark = pytest.mark.usefixtures("one_thread")


def perturb(module: torch.nn.Module, scale: float, seed: int = 0) -> None:
    """Every weight w += scale * std(w) * N(0, 1) (norm weights, all ones: 1e-3 * scale): close, not equal."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp(min=1e-3))


def eagle_like_the_base(model, eagle, scale: float = 0.02) -> None:
    """Make `eagle` (an EagleModule on a one-layer base) draft like the base one position down: fc passes the
    token's embedding through (the feature's half is zero until perturbed), the layer is the base's layer with its
    input norm; only the base's final norm is missing (sharper or flatter logits). Then perturbed by `scale`."""
    layer = model.get_decoder().layers[0]
    h = model.config.hidden_size
    eagle.layers[0].input_layernorm = copy.deepcopy(layer.input_layernorm)
    eagle.layers[0].load_state_dict(layer.state_dict())
    with torch.no_grad():
        eagle.fc.weight.zero_()
        eagle.fc.bias.zero_()
        eagle.fc.weight[:, :h] = torch.eye(h)
    perturb(eagle, scale)


@pytest.fixture(scope="module")
def one_layer_setup():
    """test_sampling's setup on a one-layer Llama, which one EAGLE layer can imitate."""
    return make_setup("llama", num_layers=1)


@pytest.fixture(scope="module")
def two_layer_setup():
    return make_setup("llama")


@pytest.fixture(scope="module")
def bigram_setup():
    """A one-layer Llama (4 key/value heads) whose attention and MLP add nothing (o_proj and down_proj zero): its
    next token depends on the last token alone, which an EAGLE-3 layer can compute at every depth (eagle3_heads)."""
    model, tok, ids, _, _ = make_setup("llama", num_layers=1, num_key_value_heads=4)
    layer = model.get_decoder().layers[0]
    with torch.no_grad():
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    return model, tok, ids, None, first_tokens_distribution(model, ids)


def eagle3_like_the_base(model, eagle3, scale: float = 0.1) -> None:
    """Make `eagle3` (an Eagle3Module on the bigram base) draft the base's next token at every depth, then perturb it
    by `scale`. q and k read the normed token embedding only, scaled so that every row attends to itself alone;
    v = [normed embedding ; -normed feature] and o_proj = I, so that h = feature + attn = the normed embedding of the
    row's token whatever feature was fed back (fc zero at depth 1; the previous depth's prediction deeper); the MLP
    adds nothing. Read out through the base's final norm (copied into the module's) and LM head (the heads' is set to
    its draft-vocabulary rows by eagle3_heads): the base's logits."""
    h = model.config.hidden_size
    layer, eye, zero = eagle3.layers[0], torch.eye(h), torch.zeros(h, h)
    with torch.no_grad():
        eagle3.out_norm.weight.copy_(model.get_decoder().norm.weight)
        eagle3.fc.weight.zero_()
        for norm in (layer.input_layernorm, layer.hidden_norm):
            norm.weight.fill_(1.0)
        layer.self_attn.q_proj.weight.copy_(torch.cat([5 * eye, zero], 1))
        layer.self_attn.k_proj.weight.copy_(torch.cat([5 * eye, zero], 1))
        layer.self_attn.v_proj.weight.copy_(torch.cat([eye, -eye], 1))
        layer.self_attn.o_proj.weight.copy_(eye)
        layer.mlp.down_proj.weight.zero_()
    perturb(eagle3, scale)


def eagle3_heads(setup):
    """EAGLE-3 heads over the 200 lowest token ids with their own LM head (the base's rows, perturbed)."""
    model = setup[0]
    config = HeadsConfig.for_base(model, "eagle3", num_heads=4, share_lm_head=False, draft_vocab_size=200)
    heads = build_heads(config, model, most_frequent(torch.arange(model.config.vocab_size, 0, -1), 200)).eval()
    eagle3_like_the_base(model, heads.eagle3)
    with torch.no_grad():
        heads.lm_heads[0].weight.copy_(heads.base_output_weights()[0])
    perturb(heads.lm_heads, 0.1, seed=1)
    return heads_drafter(heads, TREE)


def eagle_heads(setup):
    """EAGLE heads over the 200 lowest token ids (the prompt's and the likely ones among them)."""
    model = setup[0]
    config = HeadsConfig.for_base(model, "eagle", num_heads=4, share_lm_head=True, draft_vocab_size=200)
    heads = build_heads(config, model, most_frequent(torch.arange(model.config.vocab_size, 0, -1), 200)).eval()
    eagle_like_the_base(model, heads.eagle)
    return heads_drafter(heads, TREE)


def bare_eagle(setup):
    """A bare EagleModule scored by the base LM head over the full vocabulary (EagleDrafter)."""
    from models.methods.eagle.eagle import EagleModule

    eagle = EagleModule.from_base(setup[0], seed=0)
    eagle_like_the_base(setup[0], eagle)
    return EagleDrafter(eagle, TREE)


def draft_model(setup):
    """A draft model of both base layers (the base one position down), perturbed."""
    model = setup[0]
    config = HeadsConfig.for_base(model, "draft_model", num_heads=4, num_layers=2, share_lm_head=True)
    heads = build_heads(config, model).eval()
    perturb(heads.draft_model, 0.05)
    return heads_drafter(heads, TREE)


@pytest.fixture(scope="module")
def near_unigram_setup():
    """The bigram base with every token's embedding a shared vector plus half of its own: the next token's
    distribution varies a little with the last token, so one distribution drafted at every depth of a block (which a
    DFlash drafter can give: its block holds mask tokens below the root) is close to the base's, not equal."""
    model, tok, ids, _, _ = make_setup("llama", num_layers=1)
    layer, emb = model.get_decoder().layers[0], model.get_input_embeddings().weight
    with torch.no_grad():
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        emb.mul_(0.5).add_(torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(3)))
    return model, tok, ids, None, first_tokens_distribution(model, ids)


def dflash(setup):
    """A DFlash drafter whose layers add nothing (o_proj and down_proj zero): every block position drafts the base's
    distribution after the mask token, through the base's final norm and LM head; then perturbed."""
    model = setup[0]
    config = HeadsConfig.for_base(model, "dflash", num_heads=3, num_layers=1, share_lm_head=True)
    heads = build_heads(config, model).eval()
    with torch.no_grad():
        for layer in heads.dflash.layers:
            layer.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    perturb(heads.dflash, 0.3)
    return heads_drafter(heads, TREE)


DRAFTERS = {"eagle_heads": (eagle_heads, "one_layer_setup"), "bare_eagle": (bare_eagle, "one_layer_setup"),
            "eagle3_heads": (eagle3_heads, "bigram_setup"), "draft_model": (draft_model, "two_layer_setup"),
            "dflash": (dflash, "near_unigram_setup")}


def draws(setup, drafter, n, draft="sample", seed0=0):
    """Counts of the first TOKENS tokens over n generations; drafted tokens among them; first steps that accepted
    drafts at depth 2 and first steps that rejected a draft (accepted fewer than 2)."""
    model, tok, ids, _, _ = setup
    counts, drafted, deep, rejected = {}, 0, 0, 0
    for i in range(n):
        s = SamplingConfig(temperature=1.0, top_k=TOP_K, acceptance="sampling", draft=draft, seed=seed0 + i)
        res = generate(model, tok, ids, drafter, sampling=s, max_new_tokens=MAX_NEW, stop_token_ids=[])
        key = tuple(res.new_tokens[:TOKENS])
        counts[key] = counts.get(key, 0) + 1
        drafted += sum(res.from_draft[:TOKENS])
        deep += res.accept_lengths[0] == 3
        rejected += res.accept_lengths[0] < 3
    return counts, drafted, deep, rejected


@pytest.mark.parametrize("draft", ["sample", "topk"])
@pytest.mark.parametrize("kind", sorted(DRAFTERS))
def test_autoregressive_drafters_sample_the_base_distribution(kind, draft, request):
    build, fixture = DRAFTERS[kind]
    setup = request.getfixturevalue(fixture)
    n = 600
    counts, drafted, deep, rejected = draws(setup, build(setup), n, draft, seed0=50_000)
    pvalue = chi2_pvalue(counts, setup[-1], n)
    print(f"{kind} draft={draft}: p = {pvalue:.3f}, {drafted / n:.2f} drafted tokens per draw, depth 2 accepted in "
          f"{deep / n:.2f} and a draft rejected in {rejected / n:.2f} of the first steps")
    assert drafted > 0.3 * n, f"only {drafted} drafted tokens accepted in {n} draws: the test would not test much"
    assert deep > 0.05 * n, f"only {deep} of {n} first steps accepted a depth-2 draft: depth 2 is barely tested"
    assert rejected > 0.1 * n, f"only {rejected} of {n} first steps rejected a draft: the residual is barely tested"
    assert pvalue > 0.01


@pytest.mark.parametrize("kind", ["draft_model", "dflash"])
def test_a_forgotten_q_fails(kind, monkeypatch, request):
    """Negative control: the draft model's (DFlash's) sampled children judged with a uniform q instead of the q they
    were drawn from (nearly every draft accepted). (Another parent's q is no control here: its top-3 support rarely
    holds the drawn child, and a child outside q's support ends the walk with a draw from p, which is lossless.)"""
    def uniform_q(self, root, max_depth, draft=TreeDrafter.draft):
        d = draft(self, root, max_depth)
        d.draft_q = (lambda q: lambda node: torch.full_like(q(node), 1.0 / q(node).numel()))(d.draft_q)
        return d

    build, fixture = DRAFTERS[kind]
    setup = request.getfixturevalue(fixture)
    monkeypatch.setattr(TreeDrafter, "draft", uniform_q)
    counts, _, _, _ = draws(setup, build(setup), 300, seed0=50_000)
    pvalue = chi2_pvalue(counts, setup[-1], 300)
    print(f"uniform q: p = {pvalue:.2g}")
    assert pvalue < 0.01


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
def test_typical_acceptance_runs_and_repeats_under_a_seed(kind, request):
    """Typical acceptance is not lossless by design: it runs, accepts drafts and repeats itself under a seed."""
    build, fixture = DRAFTERS[kind]
    model, tok, ids, _, _ = setup = request.getfixturevalue(fixture)
    drafter = build(setup)
    runs = [generate(model, tok, ids, drafter, sampling=SamplingConfig(temperature=0.7, acceptance="typical", seed=seed),
                     max_new_tokens=20, stop_token_ids=[]) for seed in (0, 0)]
    assert runs[0].new_tokens == runs[1].new_tokens and runs[0].accept_lengths == runs[1].accept_lengths
    assert len(runs[0].new_tokens) == 20 and any(runs[0].from_draft)
