"""pytest tests/test_sampling.py: speculative sampling is lossless (chi-square), an accept-all control is not.

The acceptance rule alone (many cheap draws, random p and q) and the whole decoder on a tiny
model (the first three generated tokens, top_k=3 so there are 27 outcomes, computed exactly
from the base model) are compared with the target distribution by scipy's chi-square test.
"""
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from models.engine import acceptance
from models.engine.acceptance import NodeLogits, SamplingConfig, sample, warp_probs
from models.base import build_tiny_model
from models.engine.decoding import generate
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
TOP_K = 3


class NoisyModelHeads(torch.nn.Module):
    """Hydra-style heads whose proposals follow the base model's own distribution plus noise.

    head_logits(k, h, path) = base logits after prompt + path tokens, perturbed: q is close to p
    but not equal, so drafts are often accepted and the p/q ratio and the residual both matter.
    """

    def __init__(self, model, prompt):
        super().__init__()
        self.model, self.prompt = model, torch.tensor(prompt)
        self.config = HeadsConfig(family="hydra", num_heads=4, num_layers=1, hidden_size=model.config.hidden_size,
                                  vocab_size=model.config.vocab_size, base_model="noisy-oracle")

    def head_logits(self, k, hidden, path_tokens):
        seq = torch.cat([self.prompt.expand(path_tokens.shape[0], -1), path_tokens], 1)     # [P, T + k + 1]
        logits = self.model(seq).logits[:, -1]
        noise = torch.randn(logits.shape, generator=torch.Generator().manual_seed(int(path_tokens.sum())))
        return logits + 1.0 * noise

    def prefix_forward(self, hidden, position_ids, cache=None):
        return hidden


@pytest.fixture(scope="module")
def tiny_setup():
    model, tok = build_tiny_model(arch="llama", seed=7)
    ids = [1, 40, 80, 120, 90, 60, 30, 100]
    heads = NoisyModelHeads(model, ids)
    # exact distribution of the first three new tokens under top-k=3, temperature 1
    expected = {}
    with torch.inference_mode():
        def top(prefix):
            logits = model(torch.tensor([prefix])).logits[0, -1]
            vals, idx = torch.topk(logits, TOP_K)
            return list(zip(idx.tolist(), vals.softmax(-1).tolist()))
        for a, pa in top(ids):
            for b, pb in top(ids + [a]):
                for c, pc in top(ids + [a, b]):
                    expected[(a, b, c)] = pa * pb * pc
    return model, tok, ids, heads, expected


def decoder_draws(setup, n, heads=True, draft="sample", seed0=0):
    model, tok, ids, hd, _ = setup
    counts, drafted = Counter(), 0
    for i in range(n):
        s = SamplingConfig(temperature=1.0, top_k=TOP_K, acceptance="sampling", draft=draft, seed=seed0 + i)
        res = generate(model, tok, ids, heads=hd if heads else None, tree=dense_tree(2, 2), sampling=s,
                       max_new_tokens=3, stop_token_ids=[])
        counts[tuple(res.new_tokens)] += 1
        drafted += sum(res.from_draft)
    return counts, drafted


def test_baseline_sampler_matches_model(tiny_setup):
    counts, _ = decoder_draws(tiny_setup, 400, heads=False)
    assert chi2_pvalue(counts, tiny_setup[-1], 400) > 0.01


@pytest.mark.parametrize("draft", ["sample", "topk"])
def test_speculative_sampler_matches_model(tiny_setup, draft):
    n = 600
    counts, drafted = decoder_draws(tiny_setup, n, draft=draft, seed0=10_000)
    assert drafted > 0.3 * n, f"only {drafted} drafted tokens accepted in {n} draws: the test would not test much"
    assert chi2_pvalue(counts, tiny_setup[-1], n) > 0.01


def test_accept_all_control_fails(tiny_setup, monkeypatch):
    monkeypatch.setitem(acceptance.ACCEPTANCE, "sampling", accept_all)
    counts, _ = decoder_draws(tiny_setup, 300, seed0=20_000)
    assert chi2_pvalue(counts, tiny_setup[-1], 300) < 0.01


def test_expected_outcomes_sum_to_one(tiny_setup):
    assert abs(sum(tiny_setup[-1].values()) - 1) < 1e-5 and len(tiny_setup[-1]) == TOP_K ** 3


@pytest.mark.parametrize("family", ["medusa", "hydra"])
def test_drafted_children_come_with_their_q(family):
    """draft="sample": each parent's q is the warped distribution of the head that proposed its children."""
    from models.engine.drafting import Drafter
    from models.heads import build_heads

    model, tok = build_tiny_model(arch="qwen2", seed=1)
    heads = build_heads(HeadsConfig.for_base(model, family, num_heads=2, share_lm_head=family == "medusa"), model)
    sampling = SamplingConfig(temperature=0.8, top_k=20, acceptance="sampling", draft="sample", seed=0)
    buf = TreeBuffers.build(dense_tree(3, 2))
    with torch.inference_mode():
        drafter = Drafter(heads.eval(), sampling, torch.Generator().manual_seed(0))
        drafter.start(torch.randn(5, model.config.hidden_size))
        tokens, draft_q = drafter.draft(7, buf)
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
