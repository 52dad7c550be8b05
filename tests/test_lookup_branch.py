"""pytest tests/test_lookup_branch.py: the heads' tree with prompt lookup's chain merged in (models/engine/drafters/lookup_branch.py).

The merged tree holds exactly the heads' paths and the chain's prefixes (no duplicate siblings), greedy output
equals the baseline's for every family, with and without the per-step cost cut, the lookup branch really is
accepted (more drafts than the heads alone), and the running rate follows what came out.
"""
import pytest
import torch

from models.base import build_tiny_model
from models.engine.decoding import SamplingConfig, generate
from models.engine.drafting import LookupBranchDrafter, PromptLookupDrafter, heads_drafter, make_drafter
from models.engine.drafters.lookup_branch import merge_chain, with_branch
from models.engine.trees import TreeBuffers, TreeSpec, chain_tree, tree_from_config
from tests.test_decoding import FAMILIES, cyclic_prompt, random_heads

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = tree_from_config({"kind": "paths", "top_k": 10, "paths": [[0], [1], [0, 0], [0, 0, 0]]})   # an "optimal"-sized tree


def sequences(buf: TreeBuffers, tokens: torch.Tensor) -> set[tuple[int, ...]]:
    """The token sequence below the root of every node (root excluded)."""
    out = set()
    for i in range(1, buf.num_tokens):
        seq, node = [], i
        while node > 0:
            seq.append(int(tokens[node]))
            node = int(buf.parent[node])
        out.add(tuple(reversed(seq)))
    return out


def test_merge_chain_walks_down_matching_children():
    buf = TreeBuffers.build(SMALL)                       # nodes: root, (0), (1), (0,0), (0,0,0)
    tokens = [7, 10, 11, 12, 13]
    assert merge_chain(buf.children, tokens, [10, 12, 99]) == ([1, 3], 2)
    assert merge_chain(buf.children, tokens, [11, 12]) == ([2], 1)
    assert merge_chain(buf.children, tokens, [42]) == ([], 0)
    assert merge_chain(buf.children, tokens, [10, 12, 13]) == ([1, 3, 4], 3)
    assert merge_chain(buf.children, tokens, []) == ([], 0)


class FixedTree:
    """A TreeDrafter stand-in with fixed tokens per node: what the merge sees."""

    def __init__(self, spec, tokens):
        self.buf, self.tokens = TreeBuffers.build(spec), torch.tensor(tokens)


@pytest.mark.parametrize("chain", [[10, 12, 99, 98], [11, 50], [42, 43, 44], [10, 12, 13, 14], [10, 12, 13]])
def test_merged_tree_is_the_union_of_the_heads_paths_and_the_chain(chain):
    """Every node's token sequence is a heads' path or a prefix of the chain, each exactly once, and the
    merged buffers are a valid tree (parents first, masks of ancestors)."""
    heads = FixedTree(SMALL, [7, 10, 11, 12, 13])
    through, covered = merge_chain(heads.buf.children, heads.tokens.tolist(), chain)
    rest = chain[covered:]
    buf, tokens = heads.buf, heads.tokens
    if rest:
        buf, src = with_branch(SMALL, through[-1] if through else 0, len(rest))
        tokens = torch.cat([heads.tokens, torch.tensor(rest)])[src]
    want = sequences(heads.buf, heads.tokens) | {tuple(chain[:j]) for j in range(1, len(chain) + 1)}
    assert sequences(buf, tokens) == want and buf.num_tokens == len(want) + 1 and int(tokens[0]) == 7
    for i in range(1, buf.num_tokens):
        assert int(buf.parent[i]) < i and bool(buf.tree_mask[0, 0, i, int(buf.parent[i])])
        siblings = [int(tokens[c]) for c in buf.children[int(buf.parent[i])]]
        assert len(siblings) == len(set(siblings))


def setups():
    model, tok = build_tiny_model(arch="llama", seed=3)
    return model, tok, cyclic_prompt(model, tok)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_a_lookup_branch_equals_the_baseline(family):
    """Uncut, and cut per step with three cost profiles: flat (every node pays), steep (none does: plain
    steps) and a CPU-like one; the answer is the baseline's token for token every time."""
    model, tok, ids = setups()
    heads = random_heads(model, family)
    base = generate(model, tok, ids, max_new_tokens=60, stop_token_ids=[])
    alone = generate(model, tok, ids, heads_drafter(heads, SMALL), max_new_tokens=60, stop_token_ids=[])
    pld = generate(model, tok, ids, PromptLookupDrafter(8, 3, 2, 3), max_new_tokens=60, stop_token_ids=[])
    costs = {"uncut": None, "flat": [1.0] * 20, "steep": [1.0] + [50.0] * 19,
             "cpu": [1.0, 1.03, 1.02, 1.01, 1.05, 1.08, 1.1, 1.15, 1.18] + [1.3] * 11}
    runs = {}
    for name, cost in costs.items():
        res = generate(model, tok, ids, heads_drafter(heads, SMALL, step_cost=cost, lookup=PromptLookupDrafter(8, 3, 2, 3)), max_new_tokens=60, stop_token_ids=[])
        assert res.new_tokens == base.new_tokens, name
        assert len(res.new_tokens) == 1 + sum(res.accept_lengths)
        runs[name] = res
    # the repeating answer: the branch is accepted where the heads miss, and keeps what the heads find
    assert sum(runs["uncut"].from_draft) >= max(sum(alone.from_draft) + 3, sum(pld.from_draft))
    assert runs["uncut"].steps < min(alone.steps, pld.steps)
    assert set(runs["steep"].accept_lengths) == {1}                         # nothing pays: plain steps only
    assert runs["flat"].steps <= runs["uncut"].steps + 2


@pytest.mark.parametrize("family", ["hydra", "eagle"])
def test_typical_and_both_samplings_take_a_lookup_branch(family):
    """Typical acceptance, and lossless sampling with top-k or sampled heads' drafts (tests/test_sampling.py has
    the chi-square test of the latter); sampled drafts keep the union uncut, deterministic ones are cut."""
    model, tok, ids = setups()
    heads = random_heads(model, family)
    steep = [1.0] + [50.0] * 19                                          # no node pays for itself
    for sampling, cut in ((SamplingConfig(temperature=0.7, acceptance="typical", seed=1), True),
                          (SamplingConfig(temperature=0.7, acceptance="sampling", draft="topk", seed=1), True),
                          (SamplingConfig(temperature=0.7, acceptance="sampling", draft="sample", seed=1), False)):
        drafter = heads_drafter(heads, SMALL, step_cost=steep, lookup=PromptLookupDrafter(8, 3, 2, 3))
        sizes, draft = [], drafter.draft
        drafter.draft = lambda root, depth: (lambda d: sizes.append(d.buf.num_tokens) or d)(draft(root, depth))
        res = generate(model, tok, ids, drafter, sampling=sampling, max_new_tokens=30, stop_token_ids=[])
        assert len(res.new_tokens) == 30 == 1 + sum(res.accept_lengths)
        assert drafter.cutting == cut and (max(sizes) == 1) == cut, sampling


def test_a_lookup_branch_refuses_a_missing_tree():
    with pytest.raises(ValueError, match="needs heads=... and a tree"):
        make_drafter({"kind": "heads_lookup", "lookup": {"num_tokens": 4}})


def test_running_rate_counts_right_and_tried_lookup_tokens():
    model, _, ids = setups()
    d = LookupBranchDrafter(random_heads(model, "medusa"), chain_tree(2), PromptLookupDrafter(4, 3, 1),
                            step_cost=[1.0] * 8)
    assert d.rate(3) == 0.5                                          # the prior
    d._pending, d._accepted = (3, [5, 6, 7, 8]), [5]                 # one draft accepted, then bonus 6: 2 right,
    d._score(6)                                                      # the 3rd not known yet
    assert d.stats[3] == [2.0, 2.0] and d.rate(3) == pytest.approx(3 / 4)
    d._pending, d._accepted = (3, [5, 6, 7, 8]), [5]                 # bonus 9: 1 right, the 2nd wrong
    d._score(9)
    assert d.stats[3] == [3.0, 4.0]
    d._pending, d._accepted = (2, [5, 6]), [5, 6]                    # the whole chain right (bonus beyond it)
    d._score(9)
    assert d.stats[2] == [2.0, 2.0]
    d._pending, d._accepted = (2, [5, 6]), []                        # wrong at once
    d._score(4)
    assert d.stats[2] == [2.0, 3.0]


@pytest.mark.parametrize("family", ["medusa", "hydra_pp"])
def test_time_step_rewinds_a_lookup_branch(family):
    """time_step (the calibration's timer) takes real steps and rewinds heads, lookup index and pending chain:
    decoding on after it emits what it would have emitted without it."""
    from models.engine.decoding import decode_step, prefill, time_step

    model, tok, ids = setups()
    heads = random_heads(model, family)
    want = generate(model, tok, ids, heads_drafter(heads, SMALL, lookup=PromptLookupDrafter(8, 3, 2, 3)), max_new_tokens=30, stop_token_ids=[])
    with torch.inference_mode():
        drafter = LookupBranchDrafter(heads, SMALL, PromptLookupDrafter(8, 3, 2, 3))
        state = prefill(model, torch.tensor([ids]), SamplingConfig(), drafter=drafter)
        got = [state.root]
        while len(got) < 30:
            tokens, _ = decode_step(state, drafter, max_depth=min(8, 30 - len(got) - 1))
            got += tokens
            if len(got) < 20:
                past, root = state.past, state.root
                parts = time_step(state, drafter, max_depth=3, repeats=2)
                assert len(parts) == 2 and (state.past, state.root) == (past, root)
                assert drafter.lookup.index.tokens == (ids + got)[:past]
    assert got[:30] == want.new_tokens
