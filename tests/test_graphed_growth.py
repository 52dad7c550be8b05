"""pytest tests/test_graphed_growth.py: the grown tree at fixed shapes on the device (models/engine/drafters/
graphed_growth.py) and the device's greedy rule (acceptance.accept_on_device), on the CPU, where the walk a GPU
captures runs eagerly from the same buffers (the capture itself: tests/test_cuda.py).

- Over random proposers (ties included) and many (depth, top_k, nodes), the unpruned fixed-shape growth keeps the
  tree the pruned host growth keeps: the same token paths.
- The device's greedy rule gives the host rule's path and bonus on random trees and planted logits.
- Greedy decoding through it equals the baseline for every method, heads always right accepting their whole depth.
- It is used only where it applies, and says why not elsewhere.
"""
from __future__ import annotations

import random

import pytest
import torch

from models.base import build_tiny_model
from models.engine.acceptance import NodeLogits, SamplingConfig, accept_greedy
from models.engine.decoding import generate
from models.engine.acceptance import accept_on_device
from models.engine.drafters.base import DeviceTree
from models.engine.drafters.graphed_growth import GraphedGrowth
from models.engine.drafters.grown import as_draft, grow
from models.engine.drafting import heads_drafter
from models.engine.trees import GrownTree, TreeBuffers, TreeSpec
from tests.test_decoding import OracleHeads, cyclic_prompt, oracle_accept_lengths, prompt_ids, random_heads
from tests.test_grown_tree import AR_HEADS, CASES, TREE, V, PathProposer, path_list

pytestmark = pytest.mark.usefixtures("one_thread")


def device_paths(tree: DeviceTree) -> list[tuple[int, ...]]:
    tokens, parent = tree.tokens.tolist(), tree.parent.tolist()
    out = []
    for i, t in enumerate(tokens):
        assert i == 0 or parent[i] < i                      # drafting order: every parent first
        out.append((t,) if i == 0 else out[parent[i]] + (t,))
    return out


def check_structure(tree: DeviceTree) -> None:
    """Depths, parents and the ancestor mask describe one tree."""
    K, parent = tree.tokens.numel(), tree.parent.tolist()
    want = torch.zeros(K, K, dtype=torch.bool)
    for i in range(K):
        want[i] = want[parent[i]] if i else want[i]
        want[i, i] = True
    assert torch.equal(tree.ancestors, want) and tree.depth.tolist() == [int(r.sum()) - 1 for r in want]


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("same_per_depth", [False, True], ids=["path", "medusa"])
def test_the_fixed_shape_growth_keeps_the_pruned_growths_tree(same_per_depth, ties):
    for salt in range(2):
        proposer = PathProposer(same_per_depth, salt, ties)
        for depth, top_k, nodes in CASES:
            tree = GrownTree("t", depth, top_k, nodes)
            growth = GraphedGrowth(proposer, tree, depth + 1, capture=False)
            for root in range(V):
                grown = grow(proposer, root, tree, depth + 1, SamplingConfig(), prune=True)
                host = as_draft(grown, grown.best(nodes), tree)
                device = growth.draft(root)
                check_structure(device)
                assert sorted(device_paths(device)) == sorted(path_list(host)), (salt, depth, top_k, nodes, root)
                assert device.num_drafts == host.num_drafts
    assert growth.summary()["mode"] == "eager" and growth.summary()["fallback"] == "capture not asked for"


def planted(buf: TreeBuffers, tokens: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """Logits [N, V] whose argmax at each node is one of its children's tokens (or a token no child has) at random."""
    logits = torch.randn(buf.num_tokens, 50, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    for node, kids in enumerate(buf.children):
        choice = rng.choice(kids + [None, None]) if kids else None
        target = int(tokens[choice]) if choice is not None else rng.randrange(40, 50)
        logits[node, target] = 20.0
    return logits


def test_the_device_rule_is_the_host_rule_on_random_trees():
    rng = random.Random(0)
    for trial in range(200):
        paths = {()}
        for _ in range(rng.randrange(1, 30)):
            p = rng.choice(sorted(paths))
            if len(p) < 6:
                paths.add(p + (rng.randrange(4),))
        spec = TreeSpec(f"r{trial}", tuple(sorted(paths - {()})), 4)
        buf = TreeBuffers.build(spec)
        tokens = torch.tensor([rng.randrange(40)] + [rng.randrange(40) for _ in range(buf.num_tokens - 1)])
        for node, kids in enumerate(buf.children):          # siblings distinct, as drafted top-k children are
            for r, child in enumerate(kids):
                tokens[child] = 4 * node % 36 + r
        logits = planted(buf, tokens, rng)
        path, bonus = accept_greedy(tokens, buf, NodeLogits(logits, lambda h: h))
        tree = DeviceTree(tokens, buf.tree_mask[0, 0], buf.depth, buf.parent.clamp(min=0))
        got_path, got_drafts, got_bonus = accept_on_device(tree, logits)
        assert (got_path, got_drafts, got_bonus) == (path, tokens[path[1:]].tolist(), bonus), trial


def spied(drafter) -> list:
    kinds, draft = [], drafter.draft
    drafter.draft = lambda root, depth: kinds.append(draft(root, depth)) or kinds[-1]
    return kinds


@pytest.mark.parametrize("family", ["medusa", "hydra", "hydra_pp", "eagle", "eagle3", "draft_model"])
def test_greedy_decoding_on_the_device_tree_equals_the_baseline(family):
    model, tok = build_tiny_model(arch="llama", seed=3)
    heads = AR_HEADS[family](model) if family in AR_HEADS else random_heads(model, family)
    for ids in (cyclic_prompt(model, tok, known=12), [5]):
        base = generate(model, tok, ids, max_new_tokens=24, stop_token_ids=[])
        drafter = heads_drafter(heads, TREE)
        drafts = spied(drafter)
        res = generate(model, tok, ids, drafter, max_new_tokens=24, stop_token_ids=[], static_drafts=True)
        assert res.new_tokens == base.new_tokens and len(res.new_tokens) == 1 + sum(res.accept_lengths)
        assert isinstance(drafts[0], DeviceTree), drafter.graph_summary()
        assert drafter.graph_summary()["mode"] == "eager" and "CUDA" in drafter.graph_summary()["fallback"]


@pytest.mark.parametrize("family", ["medusa", "hydra"])
def test_heads_always_right_accept_their_whole_depth_on_the_device(family):
    model, tok = build_tiny_model(arch="llama", seed=3)
    ids = prompt_ids(tok)
    base = generate(model, tok, ids, max_new_tokens=40, stop_token_ids=[])
    heads = OracleHeads(model, ids + base.new_tokens, family)
    drafter = heads_drafter(heads, TREE)
    drafts = spied(drafter)
    res = generate(model, tok, ids, drafter, max_new_tokens=40, stop_token_ids=[], static_drafts=True)
    assert res.new_tokens == base.new_tokens and res.accept_lengths == oracle_accept_lengths(4, 40)
    assert sum(isinstance(d, DeviceTree) for d in drafts) >= len(drafts) - 2       # the last ones near the limit


def test_the_growth_stays_on_the_host_where_the_device_rule_does_not_apply():
    model, tok = build_tiny_model(arch="llama", seed=3)
    heads = random_heads(model, "hydra")
    ids = prompt_ids(tok)
    eager = heads_drafter(heads, TREE)
    generate(model, tok, ids, eager, max_new_tokens=4, stop_token_ids=[])
    assert eager.graph_summary()["fallback"].startswith("fixed-shape drafts not asked for")
    typical = heads_drafter(heads, TREE)
    s = SamplingConfig(temperature=0.7, acceptance="typical", seed=0)
    generate(model, tok, ids, typical, sampling=s, max_new_tokens=4, stop_token_ids=[], static_drafts=True)
    assert "only greedy" in typical.graph_summary()["fallback"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["medusa", "hydra", "hydra_pp", "eagle", "eagle3", "draft_model"])
def test_on_cuda_the_replayed_growth_keeps_the_host_tree_and_decodes_losslessly(family):
    from models.engine import decoding
    from models.engine.drafters.graphed import prepare_static

    model, tok = build_tiny_model(arch="llama", seed=3)
    model = model.to("cuda")
    heads = (AR_HEADS[family](model) if family in AR_HEADS else random_heads(model, family)).to("cuda")
    ids = cyclic_prompt(model, tok, known=12)
    reference = generate(model, tok, ids, max_new_tokens=40, stop_token_ids=[], static=False)
    drafter = heads_drafter(heads, TREE)
    res = generate(model, tok, ids, drafter, max_new_tokens=40, stop_token_ids=[], static=True)
    assert drafter.graph_summary()["mode"] == "cuda_graph", drafter.graph_summary()
    assert res.new_tokens == reference.new_tokens
    with torch.inference_mode():                           # the replay against the host's pruned growth, step by step
        state = decoding.prefill(model, torch.tensor([ids], device="cuda"), SamplingConfig(), drafter=drafter,
                                 static_drafts=True)
        for _ in range(6):
            replayed = drafter.draft(state.root, 64)
            prepare_static(drafter.proposer, drafter.graphed.num_nodes)
            grown = grow(drafter.proposer, state.root, TREE, drafter.graphed.levels, SamplingConfig())
            assert sorted(device_paths(replayed)) == sorted(path_list(as_draft(grown, grown.best(TREE.nodes), TREE)))
            decoding.decode_step(state, drafter, 64)
