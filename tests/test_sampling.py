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

from models.engine.drafting import heads_drafter
from models.engine import acceptance
from models.engine.acceptance import NodeLogits, SamplingConfig, sample, warp_probs
from models.base import build_tiny_model
from models.engine.decoding import generate
from models.engine.projection import BaseLogits, base_logits
from models.methods import method
from models.shared import HeadsConfig
from models.engine.drafters.base import Draft
from models.engine.trees import TreeBuffers, chain_tree, dense_tree


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
    buf = TreeBuffers.build(dense_tree(3, 1, top_k=V))
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


def point_mass_after_drawn_draws(children_q, n: int) -> tuple[Counter, int]:
    """First emitted token of a one-level tree over n draws: two children drawn from q, then the best token the
    draws missed (a prompt-lookup branch: a fixed token, chosen after the draws). -> counts, times it was taken."""
    g = torch.Generator().manual_seed(5)
    target = torch.randn(V, generator=torch.Generator().manual_seed(1)) * 1.5
    sampling = SamplingConfig(temperature=1.0, acceptance="sampling")
    q = warp_probs(torch.randn(V, generator=torch.Generator().manual_seed(4)) * 1.5, sampling)
    buf = TreeBuffers.build(dense_tree(3, 1, top_k=V))
    node_logits = NodeLogits(torch.stack([target] + [torch.zeros(V)] * 3), lambda x: x)
    counts, fixed_taken = Counter(), 0
    for _ in range(n):
        picks = torch.topk(q / torch.empty_like(q).exponential_(generator=g), 2).indices.tolist()
        fixed = next(t for t in target.argsort(descending=True).tolist() if t not in picks)
        tokens = torch.tensor([0, *picks, fixed])
        path, bonus = acceptance.accept_sampling(tokens, buf, node_logits, sampling, g, lambda node: children_q(q))
        counts[int(tokens[path[1]]) if len(path) > 1 else bonus] += 1
        fixed_taken += path[1:] == [3]
    return counts, fixed_taken, {k: float(v) for k, v in enumerate(warp_probs(target, sampling))}


def test_acceptance_rule_is_lossless_with_a_point_mass_after_drawn_children():
    """draft_q -> (q, 2): the third child is tried as a point mass after the drawn ones. Negative control: the
    same child judged by q, as if q had drawn it, fails."""
    n = 6000
    counts, fixed_taken, expected = point_mass_after_drawn_draws(lambda q: (q, 2), n)
    assert fixed_taken > 0.1 * n, f"the fixed child was accepted {fixed_taken} times in {n}: barely tested"
    assert chi2_pvalue(counts, expected, n) > 0.01
    counts, _, expected = point_mass_after_drawn_draws(lambda q: q, 3000)
    assert chi2_pvalue(counts, expected, 3000) < 0.01


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
        self.method = method("hydra")
        self.family = self.method.family

    def head_logits(self, k, hidden, path_tokens):
        seq = torch.cat([self.prompt.expand(path_tokens.shape[0], -1), path_tokens], 1)     # [P, T + k + 1]
        logits = self.model(seq).logits[:, -1]
        noise = torch.randn(logits.shape, generator=torch.Generator().manual_seed(int(path_tokens.sum())))
        return logits + self.noise * noise

    def read_hidden(self, hidden, position_ids, cache=None):
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


def decoder_draws(setup, n, heads=True, draft="sample", seed0=0, lookup=None):
    """Counts of the first TOKENS tokens over n generations, drafted tokens among them, and the draws
    whose first step accepted drafts at depths 1 and 2. lookup() -> a chain drafter merged into the tree."""
    model, tok, ids, hd, _ = setup
    counts, drafted, deep = Counter(), 0, 0
    for i in range(n):
        s = SamplingConfig(temperature=1.0, top_k=TOP_K, acceptance="sampling", draft=draft, seed=seed0 + i)
        drafter = heads_drafter(hd, TREE, lookup=lookup() if lookup else None) if heads else None
        res = generate(model, tok, ids, drafter, sampling=s, max_new_tokens=MAX_NEW, stop_token_ids=[])
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


class SecondChoiceChain:
    """A deterministic chain drafter in prompt lookup's place: 2 tokens below the root, each the model's
    second-ranked next token (a function of the context alone, as prompt lookup's chain is; second-ranked, so
    that the heads' draws often miss it and the rule must try it as a lookup child)."""

    def __init__(self, model):
        self.model = model

    def start(self, ctx):
        self.context = ctx.input_ids.tolist()

    def advance(self, hidden, tokens, position):
        self.context = self.context[:position] + list(tokens)

    def rewind(self, position):
        self.context = self.context[:position]

    def draft(self, root, max_depth):
        seq = self.context + [root]
        for _ in range(min(2, max_depth)):
            seq.append(int(self.model(torch.tensor([seq])).logits[0, -1].argsort(descending=True)[1]))
        chain = seq[len(self.context):]
        return Draft(TreeBuffers.build(chain_tree(len(chain) - 1)), torch.tensor(chain), extras={"ngram": 1})


def lookup_child_taken(record: list):
    """The real sampling rule, noting whether each verified step had a lookup child of the root and took it."""
    def rule(tokens, buf, logits, sampling, generator=None, draft_q=None):
        path, bonus = acceptance.accept_sampling(tokens, buf, logits, sampling, generator, draft_q)
        lookup_rank = buf.spec.top_k - 1 if "+lookup" in buf.spec.name else None
        record.append(lookup_rank is not None and len(path) > 1 and int(buf.ranks[path[1]]) == lookup_rank)
        return path, bonus
    return rule


def test_sampled_heads_drafts_with_a_lookup_branch_match_the_model(tiny_setup, monkeypatch):
    """Sampled heads' children (their q) and a deterministic chain merged in as a branch (a point mass, tried
    after them): the first tokens still follow the model's distribution, and the branch is taken."""
    taken = []
    monkeypatch.setitem(acceptance.ACCEPTANCE, "sampling", lookup_child_taken(taken))
    n = 600
    counts, drafted, deep = decoder_draws(tiny_setup, n, seed0=50_000, lookup=lambda: SecondChoiceChain(tiny_setup[0]))
    assert drafted > 0.3 * n and deep > 0.1 * n
    assert sum(taken) > 0.1 * n, f"a lookup child was accepted on {sum(taken)} steps of {n} draws: barely tested"
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
    from tests.proposals import propose, started
    from models.methods import build_heads

    model, tok = build_tiny_model(arch="qwen2", seed=1)
    heads = build_heads(HeadsConfig.for_base(model, family, num_heads=2, share_lm_head=family == "medusa"), model)
    sampling = SamplingConfig(temperature=0.8, top_k=20, acceptance="sampling", draft="sample", seed=0)
    buf = TreeBuffers.build(dense_tree(3, 2))
    with torch.inference_mode():
        gen = torch.Generator().manual_seed(0)
        drafter = started(heads.eval(), torch.randn(5, model.config.hidden_size), sampling, gen)
        tokens, draft_q, _ = propose(drafter, 7, buf, sampling, gen)
        for node in buf.parent_list:
            d = int(buf.depth[node])
            path = tokens[[*buf.retrieve[(buf.retrieve == node).any(1)][0, :d + 1].tolist()]][None]
            want = warp_probs(heads.head_logits(d, drafter.h[None], path if family == "hydra" else None)[0], sampling)
            torch.testing.assert_close(draft_q(node), want, rtol=1e-4, atol=1e-6)
            kids = tokens[buf.children[node]]
            assert kids.unique().numel() == kids.numel() and bool((want[kids] > 0).all())


def test_typical_acceptance_threshold_and_tie_break():
    """Accept x if p(x) > min(eps, delta * exp(-H)); equal accepted lengths go to the higher log-probability."""
    buf = TreeBuffers.build(dense_tree(3, 1, top_k=4))                   # root + children ranked 0, 1, 2
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
