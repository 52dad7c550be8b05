"""pytest tests/test_grown_tree.py: the tree grown per step (EAGLE-2's dynamic tree, models/engine/drafters/grown.py).

- Its node set equals a brute-force selection written from the algorithm's description (every candidate the
  expansion rule allows, enumerated over a 7-token vocabulary with known probabilities), at several
  (depth, top_k, nodes), for a proposer that reads the path and for one that gives a depth's nodes one row (Medusa).
- Greedy decoding with it equals the baseline token for token for every method (Medusa, Hydra, Hydra++ as oracles
  that are always right and as random heads; EAGLE, EAGLE-3, the draft model), alone and with prompt lookup
  merged in, on the tiny models and on a 7-layer base with a 1-token prompt; the head methods draft no deeper than
  their heads, the autoregressive ones as deep as the tree asks.
- Sampling acceptance with its top-k drafts follows the base distribution (chi-square, tests/test_sampling.py's
  machinery, for Hydra-style heads and a draft model; an accept-all control fails); typical acceptance runs and
  repeats under a seed; draft="sample" is refused with the reason.
- Invalid configs fail naming the value.
"""
from __future__ import annotations

import math

import pytest
import torch

from models.base import build_tiny_model
from models.engine import acceptance
from models.engine.acceptance import SamplingConfig
from models.engine.decoding import generate
from models.engine.drafters.grown import as_draft, grow
from models.engine.drafting import DraftContext, GrownTreeDrafter, PromptLookupDrafter, heads_drafter
from models.engine.trees import GrownTree, tree_from_config
from models.shared import HeadsConfig
from models.methods import build_heads
from tests.test_decoding import OracleHeads, cyclic_prompt, oracle_accept_lengths, prompt_ids, random_heads
from tests.test_eagle3 import deep_model, eagle3_heads
from tests.test_eagle_heads import eagle_heads
from tests.test_sampling import MAX_NEW, TOKENS, TOP_K, accept_all, chi2_pvalue, make_setup

pytestmark = pytest.mark.usefixtures("one_thread")

V = 7


class PathProposer:
    """Logits over V tokens that are a fixed function of the path root .. node (same_per_depth: of the depth
    alone, as Medusa's heads); draws on no model."""
    taps, draft_ids, vocab_size, max_depth = (), None, V, None

    def __init__(self, same_per_depth: bool = False, salt: int = 0, ties: bool = False):
        self.same_per_depth, self.calls, self.salt, self.ties = same_per_depth, [], salt, ties

    def logits(self, path: tuple[int, ...]) -> list[float]:
        key = (self.salt, len(path)) if self.same_per_depth else (self.salt, *path)
        g = torch.Generator().manual_seed(hash(key) % (2 ** 31))
        x = 3 * torch.randn(V, generator=g, dtype=torch.float64)
        return (x.round() if self.ties else x).tolist()          # ties: whole numbers, so scores tie often

    def begin(self, root, depth):
        self.calls.append([])

    def scores(self, frontier):
        self.calls[-1].append(frontier.nodes.numel())
        rows = [tuple(p) for p in frontier.paths.tolist()]
        return torch.tensor([self.logits(p) for p in (rows[:1] if self.same_per_depth else rows)])   # [R or 1, V]

    def end(self):
        pass

    def start(self, ctx):
        pass


def log_softmax(x: list[float]) -> list[float]:
    m = max(x)
    z = m + math.log(sum(math.exp(v - m) for v in x))
    return [v - z for v in x]


def brute_force(proposer: PathProposer, root: int, depth: int, top_k: int, nodes: int) -> set[tuple[int, ...]]:
    """The drafted token paths (root first) by the description: the root's top_k children; `depth` times, the
    top_k nodes of the newest level by cumulative log-probability each get their top_k children; of all the
    candidates, the `nodes` with the highest cumulative log-probability."""
    def children(path, score):
        lp = log_softmax(proposer.logits(path))
        best = sorted(range(V), key=lambda t: -lp[t])[:top_k]
        return [(path + (t,), score + lp[t]) for t in best]

    level = children((root,), 0.0)
    candidates = list(level)
    for _ in range(depth):
        frontier = sorted(level, key=lambda c: -c[1])[:top_k]
        level = [child for path, score in frontier for child in children(path, score)]
        candidates += level
    return {(root,)} | {path for path, _ in sorted(candidates, key=lambda c: -c[1])[:nodes]}


def drafted_paths(draft) -> set[tuple[int, ...]]:
    tokens, parent = draft.tokens.tolist(), draft.buf.parent.tolist()

    def path(i):
        return (tokens[i],) if parent[i] < 0 else path(parent[i]) + (tokens[i],)
    return {path(i) for i in range(len(tokens))}


@pytest.mark.parametrize("same_per_depth", [False, True], ids=["path", "medusa"])
@pytest.mark.parametrize("depth,top_k,nodes", [(0, 3, 2), (1, 2, 5), (2, 3, 7), (3, 2, 9), (4, 3, 40), (5, 1, 3)])
def test_the_grown_tree_is_the_brute_force_selection(depth, top_k, nodes, same_per_depth):
    proposer = PathProposer(same_per_depth)
    drafter = GrownTreeDrafter(None, GrownTree("t", depth, top_k, nodes), proposer=proposer)
    drafter.start(DraftContext(torch.tensor([1]), torch.zeros(1, 4), SamplingConfig()))
    for root in range(V):
        draft = drafter.draft(root, max_depth=100)
        want = brute_force(proposer, root, depth, top_k, nodes)
        assert drafted_paths(draft) == want and draft.num_drafts == min(nodes, len(want) - 1) == len(want) - 1
        calls = proposer.calls[-1]                    # one scores call a depth, over the frontier the pruning leaves
        assert calls[0] == 1 and len(calls) <= depth + 1 and all(c <= top_k for c in calls)
        logp = {(root,): 0.0}
        for p in sorted(want, key=len)[1:]:
            logp[p] = logp[p[:-1]] + log_softmax(proposer.logits(p[:-1]))[p[-1]]
        assert draft.node_probs.tolist() == pytest.approx([math.exp(logp[p]) for p in path_list(draft)], rel=1e-5)


CASES = [(d, k, n) for d in (0, 1, 2, 3, 5) for k in (1, 2, 3, 4) for n in (1, 2, 3, 5, 8, 20)]


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("same_per_depth", [False, True], ids=["path", "medusa"])
def test_the_pruned_growth_keeps_the_unpruned_tree(same_per_depth, ties):
    """Over random proposers and many (depth, top_k, nodes): the tree kept after pruning is the one kept without it,
    token, rank path and probability alike, ties included; and the pruning does skip frontier rows."""
    rows = {True: 0, False: 0}
    for salt in range(3):
        proposer = PathProposer(same_per_depth, salt, ties)
        for depth, top_k, nodes in CASES:
            tree = GrownTree("t", depth, top_k, nodes)
            for root in range(V):
                kept = {}
                for prune in (False, True):
                    grown = grow(proposer, root, tree, depth + 1, SamplingConfig(), prune=prune)
                    rows[prune] += sum(proposer.calls[-1])
                    kept[prune] = as_draft(grown, grown.best(nodes), tree)
                a, b = kept[False], kept[True]
                assert a.buf.spec.paths == b.buf.spec.paths, (salt, depth, top_k, nodes, root)
                assert torch.equal(a.tokens, b.tokens) and torch.equal(a.node_probs, b.node_probs)
    assert rows[True] < 0.8 * rows[False], rows


def path_list(draft) -> list[tuple[int, ...]]:
    tokens, parent = draft.tokens.tolist(), draft.buf.parent.tolist()
    out = []
    for i, t in enumerate(tokens):
        out.append((t,) if parent[i] < 0 else out[parent[i]] + (t,))
    return out


def test_near_the_limits_the_tree_is_shallower():
    proposer = PathProposer()
    drafter = GrownTreeDrafter(None, GrownTree("t", 4, 2, 20), proposer=proposer)
    drafter.start(DraftContext(torch.tensor([1]), torch.zeros(1, 4), SamplingConfig()))
    assert drafter.draft(3, max_depth=2).buf.spec.depth <= 2 and drafter.draft(3, max_depth=0).num_drafts == 0


# -- greedy: lossless for every method ---------------------------------------------------------------------------

TREE = GrownTree("eagle2_test", depth=6, top_k=3, nodes=12)


def greedy_equal(model, tok, ids, heads, n=24, tree=TREE, accepted=None):
    accepted = [] if accepted is None else accepted
    base = generate(model, tok, ids, max_new_tokens=n, stop_token_ids=[])
    for lookup in (None, PromptLookupDrafter(num_tokens=6)):
        res = generate(model, tok, ids, heads_drafter(heads, tree, lookup=lookup), max_new_tokens=n,
                       stop_token_ids=[])
        assert res.new_tokens == base.new_tokens, f"{heads.config.family} (lookup: {lookup is not None}) differs"
        assert len(res.new_tokens) == 1 + sum(res.accept_lengths)
        accepted.append(max(res.accept_lengths))
    return res


@pytest.mark.parametrize("family", ["medusa", "hydra", "hydra_pp"])
def test_greedy_oracle_heads_accept_their_whole_depth(family):
    """Heads always right at rank 0: every step accepts as many drafts as there are heads (4), not the tree's 7
    levels, and equals the baseline."""
    model, tok = build_tiny_model(arch="llama", seed=3)
    ids = prompt_ids(tok)
    base = generate(model, tok, ids, max_new_tokens=40, stop_token_ids=[])
    heads = OracleHeads(model, ids + base.new_tokens, family)
    drafter = heads_drafter(heads, TREE)
    res = generate(model, tok, ids, drafter, max_new_tokens=40, stop_token_ids=[])
    assert res.new_tokens == base.new_tokens and res.accept_lengths == oracle_accept_lengths(4, 40)
    assert heads.max_snap < OracleHeads.SNAP_TOL


def draft_model_heads(model):
    config = HeadsConfig.for_base(model, "draft_model", num_heads=2, num_layers=1, share_lm_head=True)
    return build_heads(config, model).eval()


AR_HEADS = {"eagle": lambda m: eagle_heads(m, depths=2).eval(), "draft_model": draft_model_heads,
            "eagle3": lambda m: eagle3_heads(m, depths=2, noise=0.2).eval()}


@pytest.mark.parametrize("family", ["eagle", "eagle3", "draft_model"])
def test_the_root_pair_run_with_the_accepted_pairs_drafts_and_decodes_as_before(family):
    """The autoregressive drafters write a step's accepted pairs and the next root's pair in one forward: the same
    trees (tokens and probabilities), the same accepted lengths and output as the root run on its own, about one draft
    forward a step fewer, on a grown tree and a fixed one."""
    model, tok = build_tiny_model(seed=0)
    heads = AR_HEADS[family](model)
    ids = cyclic_prompt(model, tok, known=12)
    for tree in (TREE, tree_from_config({"kind": "paths", "top_k": 3, "paths": [[0], [1], [0, 0], [0, 1], [1, 0]]})):
        runs = {}
        for fold in (True, False):
            drafter = heads_drafter(heads, tree)
            drafter.proposer.fold_root = fold
            forwards = []
            hook = heads.draft_module.register_forward_pre_hook(lambda *_: forwards.append(1))
            drafts = []
            draft = drafter.draft
            drafter.draft = lambda root, depth: drafts.append(draft(root, depth)) or drafts[-1]
            try:
                res = generate(model, tok, ids, drafter, max_new_tokens=24, stop_token_ids=[])
            finally:
                hook.remove()
            runs[fold] = res, drafts, len(forwards)
        (res, drafts, n), (ref, ref_drafts, ref_n) = runs[True], runs[False]
        assert res.new_tokens == ref.new_tokens and res.accept_lengths == ref.accept_lengths
        for a, b in zip(drafts, ref_drafts, strict=True):
            assert torch.equal(a.tokens, b.tokens)
            if a.node_probs is not None:          # one forward of m + 1 rows, not two: float32 rounding apart
                torch.testing.assert_close(a.node_probs, b.node_probs, rtol=1e-3, atol=1e-6)
        # the root's own forward is gone, once a step (steps near the length limit, drafting nothing, flush alone)
        assert ref_n - n >= res.steps - 2


@pytest.mark.parametrize("family", ["medusa", "hydra", "hydra_pp", "eagle", "eagle3", "draft_model"])
def test_greedy_every_method_equals_the_baseline(family):
    """Tiny model, a repetitive prompt (lookups accepted); the 7-layer base with a 1-token prompt."""
    for model, tok in (build_tiny_model(arch="llama", seed=3), deep_model(seed=4)):
        heads = AR_HEADS[family](model) if family in AR_HEADS else random_heads(model, family)
        accepted = []
        for ids in (cyclic_prompt(model, tok, known=12), [5]):
            greedy_equal(model, tok, ids, heads, accepted=accepted)
        assert max(accepted) > 2, f"{family}: no step accepted two drafts: the merged tree is barely tested"


@pytest.mark.parametrize("family", ["medusa", "eagle"])
def test_heads_stop_at_their_number_the_autoregressive_drafters_go_deeper(family):
    model, tok = build_tiny_model(arch="llama", seed=3)
    heads = eagle_heads(model, depths=2).eval() if family == "eagle" else random_heads(model, family)
    depths = []
    drafter = heads_drafter(heads, GrownTree("deep", depth=6, top_k=1, nodes=7))
    draft = drafter.draft

    def spy(root, max_depth):
        d = draft(root, max_depth)
        depths.append(d.buf.spec.depth)
        return d
    drafter.draft = spy
    generate(model, tok, prompt_ids(tok), drafter, max_new_tokens=12, stop_token_ids=[])
    assert max(depths) == (7 if family == "eagle" else heads.config.num_heads)


# -- sampling ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_setup():
    return make_setup("llama")


@pytest.fixture(scope="module")
def two_layer_setup():
    """tiny_setup's base with a draft model of both its layers (the base one position down), perturbed."""
    from tests.test_sampling_ar import perturb

    model, tok, ids, _, expected = make_setup("llama")
    config = HeadsConfig.for_base(model, "draft_model", num_heads=4, num_layers=2, share_lm_head=True)
    heads = build_heads(config, model).eval()
    perturb(heads.draft_model, 0.05)
    return model, tok, ids, heads, expected


def sampled(setup, n, tree, draft="topk", seed0=0):
    model, tok, ids, heads, _ = setup
    counts, drafted = {}, 0
    for i in range(n):
        s = SamplingConfig(temperature=1.0, top_k=TOP_K, acceptance="sampling", draft=draft, seed=seed0 + i)
        res = generate(model, tok, ids, heads_drafter(heads, tree), sampling=s, max_new_tokens=MAX_NEW,
                       stop_token_ids=[])
        key = tuple(res.new_tokens[:TOKENS])
        counts[key] = counts.get(key, 0) + 1
        drafted += sum(res.from_draft[:TOKENS])
    return counts, drafted


SAMPLING_TREE = GrownTree("s", depth=1, top_k=2, nodes=4)


@pytest.mark.parametrize("setup", ["tiny_setup", "two_layer_setup"], ids=["hydra", "draft_model"])
def test_sampling_acceptance_with_grown_top_k_drafts_follows_the_base(setup, request):
    """Hydra heads that read the base's own logits plus noise (tests/test_sampling.py), and a draft model."""
    setup = request.getfixturevalue(setup)
    n = 600
    counts, drafted = sampled(setup, n, SAMPLING_TREE, seed0=60_000)
    assert drafted > 0.3 * n, f"only {drafted} drafted tokens accepted in {n} draws: the test would not test much"
    assert chi2_pvalue(counts, setup[-1], n) > 0.01


def test_typical_acceptance_runs_on_the_grown_tree_and_repeats_under_a_seed(two_layer_setup):
    """Typical acceptance is not lossless by design: it runs, accepts drafts and repeats itself under a seed."""
    model, tok, ids, heads, _ = two_layer_setup
    runs = [generate(model, tok, ids, heads_drafter(heads, SAMPLING_TREE), max_new_tokens=20, stop_token_ids=[],
                     sampling=SamplingConfig(temperature=0.7, acceptance="typical", seed=0)) for _ in range(2)]
    assert runs[0].new_tokens == runs[1].new_tokens and len(runs[0].new_tokens) == 20 and any(runs[0].from_draft)


def test_accept_all_control_fails_on_the_grown_tree(tiny_setup, monkeypatch):
    monkeypatch.setitem(acceptance.ACCEPTANCE, "sampling", accept_all)
    counts, _ = sampled(tiny_setup, 300, SAMPLING_TREE, seed0=70_000)
    assert chi2_pvalue(counts, tiny_setup[-1], 300) < 0.01


def test_sampled_drafts_are_refused_with_the_reason(tiny_setup):
    model, tok, ids, heads, _ = tiny_setup
    s = SamplingConfig(temperature=1.0, acceptance="sampling", draft="sample", seed=0)
    with pytest.raises(ValueError, match="draft='sample'.*every draw"):
        generate(model, tok, ids, heads_drafter(heads, SAMPLING_TREE), sampling=s, max_new_tokens=4)


# -- invalid configs ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key,value", [("nodes", 0), ("depth", -1), ("top_k", 0), ("depth", 2.5), ("nodes", "8"),
                                       ("top_k", True)])
def test_invalid_grown_tree_configs_name_the_value(key, value):
    cfg = {"kind": "grown", "name": "bad", "depth": 5, "top_k": 10, "nodes": 59, key: value}
    with pytest.raises(ValueError, match=f"{key}={value!r}"):
        tree_from_config(cfg)


def test_top_k_larger_than_the_draft_vocabulary_is_refused():
    model, _ = build_tiny_model(arch="llama", seed=3)
    heads = eagle_heads(model, depths=2, vocab=48)
    with pytest.raises(ValueError, match="top_k=49 is larger than the draft vocabulary \\(48 tokens\\)"):
        heads_drafter(heads, GrownTree("wide", depth=1, top_k=49, nodes=8))


def test_the_authors_defaults_load():
    from tests.test_decoding import conf_tree

    tree = conf_tree("eagle2")
    assert (tree.depth, tree.top_k, tree.nodes, tree.levels) == (5, 10, 59, 6)
