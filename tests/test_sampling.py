"""pytest tests/test_sampling.py: speculative sampling is lossless (chi-square), an accept-all control is not.

The acceptance rule alone (many cheap draws, random p and q) and the whole decoder on a tiny
model (the first three generated tokens, top_k=3 so there are 27 outcomes, computed exactly
from the base model's own logits; the first step drafts and verifies a depth-2 tree) are compared
with the target distribution by scipy's chi-square test, on Llama and on Granite, whose forward
divides its logits by logits_scaling. Broken variants (accept all, no residual at depth 2, one
parent's q for all, the logit transform dropped) must fail it.
"""
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from models.engine.drafters import heads_drafter
from models.engine import acceptance
from models.engine.acceptance import NodeLogits, SamplingConfig, sample, warp_probs
from models.base import build_tiny_model
from models.engine.decoding import generate
from models.engine.projection import BaseLogits, base_logits
from models.heads import HeadsConfig
from models.engine.trees import TreeBuffers, dense_tree


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py: tiny tensors run fastest on one thread


def chi2_pvalue(counts: Counter, expected: dict, n: int) -> float:
    """Chi-square p-value of observed counts against expected probabilities (bins below 5 pooled)."""
    big = [k for k, p in expected.items() if p * n >= 5]
    obs = [counts.get(k, 0) for k in big] + [n - sum(counts.get(k, 0) for k in big)]
    exp = [expected[k] * n for k in big] + [n - sum(expected[k] * n for k in big)]
    if exp[-1] < 1e-6:
        obs, exp = obs[:-1], exp[:-1]
    exp = [e * sum(obs) / sum(exp) for e in exp]         # float32 probabilities sum to 1 only up to rounding
    return float(chisquare(obs, exp).pvalue)


def accept_all(tokens, buf, logits, sampling, generator=None, draft_q=None):
    """Negative control: every first-ranked draft is accepted down to a leaf."""
    path = [0]
    while buf.children[path[-1]]:
        path.append(buf.children[path[-1]][0])
    return path, sample(warp_probs(logits.rows([path[-1]])[0], sampling), generator)


def accept_without_residual(tokens, buf, logits, sampling, generator=None, draft_q=None):
    """Negative control: min(1, p/q) acceptance, but a rejection resamples from p instead of the residual."""
    p = warp_probs(logits.rows([0])[0], sampling)
    for child in buf.children[0]:
        x = int(tokens[child])
        q = draft_q(0)
        if float(torch.rand((), generator=generator)) < min(1.0, float(p[x] / q[x])):
            return [0, child], 0
    return [0], sample(p, generator)


# -- the acceptance rule alone ---------------------------------------------------------------------
V = 8


def first_token_draws(rule, draft: str, n: int, seed: int = 0) -> Counter:
    """First emitted token of a one-level tree (3 children) over n draws with fixed random p and q."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(V, generator=torch.Generator().manual_seed(1)) * 1.5     # base logits at the root
    draft_logits = torch.randn(V, generator=torch.Generator().manual_seed(2)) * 1.5
    sampling = SamplingConfig(temperature=1.0, acceptance="sampling", draft=draft)
    buf = TreeBuffers.build(dense_tree(3, 1, topk=V))
    rows = torch.stack([target] + [torch.zeros(V)] * 3)                           # [N, V]; leaves unused
    node_logits = NodeLogits(rows, lambda x: x)
    q = warp_probs(draft_logits, sampling)
    counts = Counter()
    for _ in range(n):
        if draft == "sample":                                                     # 3 draws without replacement
            picks = torch.topk(q / torch.empty_like(q).exponential_(generator=g), 3).indices
        else:
            picks = torch.topk(draft_logits, 3).indices
        tokens = torch.cat([torch.tensor([0]), picks])
        path, bonus = rule(tokens, buf, node_logits, sampling, g, (lambda node: q) if draft == "sample" else None)
        counts[int(tokens[path[1]]) if len(path) > 1 else bonus] += 1
    return counts, {k: float(v) for k, v in enumerate(warp_probs(target, sampling))}


@pytest.mark.parametrize("draft", ["sample", "topk"])
def test_acceptance_rule_is_lossless(draft):
    counts, expected = first_token_draws(acceptance.accept_sampling, draft, 6000)
    assert chi2_pvalue(counts, expected, 6000) > 0.01


def test_acceptance_rule_controls_fail():
    counts, expected = first_token_draws(accept_all, "sample", 2000)
    assert chi2_pvalue(counts, expected, 2000) < 0.01
    counts, expected = first_token_draws(accept_without_residual, "sample", 6000)
    assert chi2_pvalue(counts, expected, 6000) < 0.01


# -- the whole decoder on a tiny model -------------------------------------------------------------
TOP_K, TOKENS = 3, 3                 # the first three new tokens under top_k=3: 27 outcomes
TREE = dense_tree(2, 2)              # 2 drafts below the root, 2 below each: depth 2 is drafted and verified...
MAX_NEW = TOKENS + 1                 # ...because the token limit leaves the first step its full depth


class NoisyModelHeads(torch.nn.Module):
    """Hydra-style heads whose proposals follow the base model's own distribution plus noise.

    head_logits(k, h, path) = base logits after prompt + path tokens, perturbed: q is close to p
    but not equal, so drafts are often accepted and the p/q ratio and the residual both matter.
    """

    def __init__(self, model, prompt, noise=1.0):
        super().__init__()
        self.model, self.prompt, self.noise = model, torch.tensor(prompt), noise
        self.config = HeadsConfig(family="hydra", num_heads=4, num_layers=1, hidden_size=model.config.hidden_size,
                                  vocab_size=model.config.vocab_size, base_model="noisy-oracle")

    def head_logits(self, k, hidden, path_tokens):
        seq = torch.cat([self.prompt.expand(path_tokens.shape[0], -1), path_tokens], 1)     # [P, T + k + 1]
        logits = self.model(seq).logits[:, -1]
        noise = torch.randn(logits.shape, generator=torch.Generator().manual_seed(int(path_tokens.sum())))
        return logits + self.noise * noise

    def prefix_forward(self, hidden, position_ids, cache=None):
        return hidden


def first_tokens_distribution(model, ids) -> dict:
    """The exact distribution of the first TOKENS new tokens under top_k=TOP_K, from the model's own logits."""
    expected = {(): 1.0}
    with torch.inference_mode():
        for _ in range(TOKENS):
            grown = {}
            for seq, p in expected.items():
                vals, idx = torch.topk(model(torch.tensor([ids + list(seq)])).logits[0, -1], TOP_K)
                grown.update({seq + (t,): p * pt for t, pt in zip(idx.tolist(), vals.softmax(-1).tolist())})
            expected = grown
    return expected


def make_setup(arch, noise=1.0, **overrides):
    """(model, tok, prompt, heads, exact distribution of the first TOKENS new tokens from model(ids).logits)."""
    model, tok = build_tiny_model(arch=arch, seed=7, **overrides)
    ids = [1, 40, 80, 120, 90, 60, 30, 100]
    return model, tok, ids, NoisyModelHeads(model, ids, noise), first_tokens_distribution(model, ids)


@pytest.fixture(scope="module")
def tiny_setup():
    return make_setup("llama")


@pytest.fixture(scope="module")
def granite_setup():
    """Granite divides its logits by logits_scaling: 4 turns the top-3 distribution almost uniform (the heads'
    noise scaled down with it, so that depth 2 is accepted as often as on Llama)."""
    return make_setup("granite", noise=0.25, logits_scaling=4.0)


def decoder_draws(setup, n, heads=True, draft="sample", seed0=0):
    """Counts of the first TOKENS tokens over n generations, drafted tokens among them, and the draws
    whose first step accepted drafts at depths 1 and 2."""
    model, tok, ids, hd, _ = setup
    counts, drafted, deep = Counter(), 0, 0
    for i in range(n):
        s = SamplingConfig(temperature=1.0, top_k=TOP_K, acceptance="sampling", draft=draft, seed=seed0 + i)
        res = generate(model, tok, ids, heads_drafter(hd, TREE) if heads else None, sampling=s, max_new_tokens=MAX_NEW, stop_token_ids=[])
        counts[tuple(res.new_tokens[:TOKENS])] += 1
        drafted += sum(res.from_draft[:TOKENS])
        deep += res.accept_lengths[0] == 3
    return counts, drafted, deep


def test_baseline_sampler_matches_model(tiny_setup):
    counts, _, _ = decoder_draws(tiny_setup, 400, heads=False)
    assert chi2_pvalue(counts, tiny_setup[-1], 400) > 0.01


@pytest.mark.parametrize("draft", ["sample", "topk"])
def test_speculative_sampler_matches_model(tiny_setup, draft):
    n = 600
    counts, drafted, deep = decoder_draws(tiny_setup, n, draft=draft, seed0=10_000)
    assert drafted > 0.3 * n, f"only {drafted} drafted tokens accepted in {n} draws: the test would not test much"
    assert deep > 0.1 * n, f"only {deep} of {n} first steps accepted a depth-2 draft: depth 2 is barely tested"
    assert chi2_pvalue(counts, tiny_setup[-1], n) > 0.01


def test_accept_all_control_fails(tiny_setup, monkeypatch):
    monkeypatch.setitem(acceptance.ACCEPTANCE, "sampling", accept_all)
    counts, _, _ = decoder_draws(tiny_setup, 300, seed0=20_000)
    assert chi2_pvalue(counts, tiny_setup[-1], 300) < 0.01


def no_residual_below_root(tokens, buf, logits, sampling, generator=None, draft_q=None):
    """Negative control: the real rule, but once every depth-2 draft is rejected the bonus comes from p
    at their parent instead of the residual."""
    path, bonus = acceptance.accept_sampling(tokens, buf, logits, sampling, generator, draft_q)
    if len(path) == 2 and buf.children[path[1]]:
        bonus = sample(warp_probs(logits.rows([path[1]])[0], sampling), generator)
    return path, bonus


def test_no_residual_at_depth_two_control_fails(tiny_setup, monkeypatch):
    monkeypatch.setitem(acceptance.ACCEPTANCE, "sampling", no_residual_below_root)
    counts, _, _ = decoder_draws(tiny_setup, 600, seed0=10_000)
    assert chi2_pvalue(counts, tiny_setup[-1], 600) < 0.01


def test_expected_outcomes_sum_to_one(tiny_setup, granite_setup):
    for setup in (tiny_setup, granite_setup):
        assert abs(sum(setup[-1].values()) - 1) < 1e-5 and len(setup[-1]) == TOP_K ** TOKENS


def test_sampler_matches_a_model_that_scales_its_logits(granite_setup):
    """Lossless means the model's own distribution: Granite's logits / logits_scaling, not lm_head's."""
    n = 600
    counts, drafted, deep = decoder_draws(granite_setup, n, seed0=30_000)
    assert drafted > 0.3 * n and deep > 0.1 * n
    assert chi2_pvalue(counts, granite_setup[-1], n) > 0.01


def test_dropping_the_logit_transform_fails(granite_setup, monkeypatch):
    """Negative control: the engine on lm_head's logits alone (its check passed before the transform went)."""
    base_logits(granite_setup[0])
    monkeypatch.setattr(BaseLogits, "transform", lambda self, logits: logits)
    counts, _, _ = decoder_draws(granite_setup, 300, seed0=40_000)
    assert chi2_pvalue(counts, granite_setup[-1], 300) < 0.01


@pytest.mark.parametrize("family", ["medusa", "hydra"])
def test_drafted_children_come_with_their_q(family):
    """draft="sample": each parent's q is the warped distribution of the head that proposed its children."""
    from models.engine.drafters import HeadsDrafter
    from models.heads import build_heads

    model, tok = build_tiny_model(arch="qwen2", seed=1)
    heads = build_heads(HeadsConfig.for_base(model, family, num_heads=2, share_lm_head=family == "medusa"), model)
    sampling = SamplingConfig(temperature=0.8, top_k=20, acceptance="sampling", draft="sample", seed=0)
    buf = TreeBuffers.build(dense_tree(3, 2))
    with torch.inference_mode():
        drafter = HeadsDrafter(heads.eval())
        drafter.start(torch.randn(5, model.config.hidden_size), sampling, torch.Generator().manual_seed(0))
        tokens, draft_q, _ = drafter.draft(7, buf)
        for node in buf.parent_list:
            d = int(buf.depth[node])
            path = tokens[[*buf.retrieve[(buf.retrieve == node).any(1)][0, :d + 1].tolist()]][None]
            want = warp_probs(heads.head_logits(d, drafter.h[None], path if family == "hydra" else None)[0], sampling)
            torch.testing.assert_close(draft_q(node), want, rtol=1e-4, atol=1e-6)
            kids = tokens[buf.children[node]]
            assert kids.unique().numel() == kids.numel() and bool((want[kids] > 0).all())


def test_typical_acceptance_threshold_and_tie_break():
    """Accept x if p(x) > min(eps, delta * exp(-H)); equal accepted lengths go to the higher log-probability."""
    buf = TreeBuffers.build(dense_tree(3, 1, topk=4))                   # root + children ranked 0, 1, 2
    root = torch.log(torch.tensor([0.05, 0.30, 0.60, 0.05]))            # H = 0.97 -> threshold min(0.09, 0.11) = 0.09
    rows = torch.stack([root] + [torch.zeros(4)] * 3)
    sampling = SamplingConfig(temperature=1.0, acceptance="typical", seed=0)
    for children, want in [([0, 1, 2], 2), ([0, 3, 1], 1), ([0, 3], None)]:
        tokens = torch.tensor([0] + children + [0] * (3 - len(children)))
        path, _ = acceptance.accept_typical(tokens, buf, NodeLogits(rows, lambda x: x), sampling,
                                            torch.Generator().manual_seed(0))
        got = int(tokens[path[1]]) if len(path) > 1 else None
        assert got == want, (children, path)
    strict = SamplingConfig(temperature=1.0, acceptance="typical", epsilon=0.5, delta=0.3)   # threshold 0.11
    path, _ = acceptance.accept_typical(torch.tensor([0, 1, 2, 3]), buf, NodeLogits(rows, lambda x: x), strict)
    assert int(torch.tensor([0, 1, 2, 3])[path[1]]) == 2
