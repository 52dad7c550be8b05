"""pytest tests/test_tree_oracle.py: the oracle beside the tree grown per step (models/measure/tree_oracle.py) and
its benchmark (pipelines/bench/tree_oracle.py).

- the oracle of a node budget equals a brute force over every ancestor-closed set of that many candidates, on random
  grown trees; the grown tree's own choice never beats it;
- the steps walk as decoding does, and agreement is judged before the answer's last tokens;
- on a tiny model, the bench's replay of stored evaluation records equals the decoder's steps.
"""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from models.engine.drafters.grown import Grown
from models.measure.grown_calibration import GrownReplay, accepted_drafts, record
from models.measure.tree_oracle import candidate_drafts, oracle_drafts, steps_agree, walk_steps

pytestmark = pytest.mark.usefixtures("one_thread")


def random_grown(rng: np.random.Generator, size: int, levels: int) -> Grown:
    """A candidate tree of `size` nodes at most `levels` deep, siblings' tokens distinct, scores falling with depth."""
    g = Grown(size, levels, root=0, device=torch.device("cpu"))
    depth = [0]
    for i in range(1, size):
        parent = int(rng.choice([j for j in range(i) if depth[j] < levels]))
        taken = {int(g.tokens[j]) for j in range(1, i) if int(g.parent[j]) == parent}
        g.tokens[i] = int(rng.choice([t for t in range(1, 9) if t not in taken]))
        g.parent[i], g.score[i] = parent, float(g.score[parent]) - float(rng.uniform(0.01, 2.0))
        g.ancestors[i] = g.ancestors[parent]
        g.ancestors[i, i] = True
        depth.append(depth[parent] + 1)
        g.n = i + 1
    return g


def brute_force(g: Grown, targets: list[int], levels: int, nodes: int) -> int:
    """The most drafts greedy acceptance takes from any ancestor-closed set of at most `nodes` candidates (the root
    not counted) of the first `levels` levels."""
    parent, tokens = g.parent[:g.n].tolist(), g.tokens[:g.n].tolist()
    level = (g.ancestors[:g.n, :g.n].sum(-1) - 1).tolist()
    pool = [i for i in range(1, g.n) if level[i] <= levels]
    best = 0
    for size in range(1, min(nodes, len(pool)) + 1):
        for subset in itertools.combinations(pool, size):
            kept = set(subset) | {0}
            if any(parent[i] not in kept for i in subset):
                continue
            node, depth = 0, 0
            while depth < len(targets):
                child = [i for i in subset if parent[i] == node and tokens[i] == targets[depth]]
                if not child:
                    break
                node, depth = child[0], depth + 1
            best = max(best, depth)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_oracle_is_the_best_tree_of_its_size_and_the_grown_tree_never_beats_it(seed):
    rng = np.random.default_rng(seed)
    g = random_grown(rng, size=9, levels=3)
    end = int(rng.integers(1, g.n))                       # the base's path: down to a random node, then off the tree
    path = [end]
    while int(g.parent[path[-1]]) > 0:
        path.append(int(g.parent[path[-1]]))
    targets = [int(g.tokens[i]) for i in reversed(path)] + [99]
    replay = GrownReplay(2, [], [], [])
    record(replay, g, targets)
    for levels in (1, 2, 3):
        assert candidate_drafts(replay, levels)[0] == brute_force(g, targets, levels, g.n)
        for nodes in (1, 2, 3, 5):
            oracle = int(oracle_drafts(replay, levels, nodes)[0])
            assert oracle == brute_force(g, targets, levels, nodes), (levels, nodes)
            assert int(accepted_drafts(replay, levels, nodes)[0]) <= oracle


def test_a_budget_of_no_nodes_is_refused_by_name():
    replay = GrownReplay(2, [[1]], [[1]], [np.array([0, 1])])
    with pytest.raises(ValueError, match="nodes=0"):
        oracle_drafts(replay, 2, 0)


def test_steps_jump_by_what_each_step_emits_and_agree_before_the_tail():
    assert walk_steps(np.array([2, 0, 0, 1, 0, 3, 0, 0, 0])) == [3, 2, 4]
    assert walk_steps(np.array([], dtype=np.int64)) == []
    assert steps_agree([3, 2, 4], [3, 2, 1, 1], tail=3)          # differs only in the last 3 tokens
    assert not steps_agree([3, 2, 4], [2, 3, 4], tail=3)


def test_the_bench_replays_stored_records_as_the_decoder_stepped(tmp_path):
    """Records written as evaluate writes them (prompt, the baseline's tokens, each method's tokens per step) for a
    tiny EAGLE whose drafts are partly right: the replayed grown tree steps as the decoder did on every question,
    the oracle accepts at least as much, the ceiling at least as much as the oracle."""
    from models.engine.decoding import generate
    from models.engine.drafting import heads_drafter
    from models.engine.trees import GrownTree, tree_from_config
    from pipelines.bench.tree_oracle import load_records, replay_setting, summarise
    from tests.test_grown_pipeline import fitted_heads

    model, tok, heads, prompts, seqs = fitted_heads("eagle", None)
    grown = GrownTree("dynamic_optimal", depth=3, top_k=3, nodes=6)
    fixed = tree_from_config({"kind": "paths", "top_k": 3, "paths": [[0], [1], [0, 0]]})
    folder = tmp_path / "eagle"
    folder.mkdir()
    for qid, (p, s) in enumerate(zip(prompts, seqs)):
        steps = {m: generate(model, tok, p, heads_drafter(heads, t), max_new_tokens=len(s) - len(p),
                             stop_token_ids=[]).accept_lengths for m, t in (("eagle-dynamic_optimal", grown),
                                                                             ("eagle-optimal", fixed))}
        records = {"baseline": [{"tokens": s[len(p):], "accept_lengths": [1] * (len(s) - len(p) - 1)}],
                   **{m: [{"tokens": s[len(p):], "accept_lengths": a}] for m, a in steps.items()}}
        (folder / f"r0-q{qid}.json").write_text(json.dumps({"question_id": qid, "prompts": [p], "records": records}))
    loaded = load_records(folder, "baseline")
    assert sorted(loaded) == [0, 1] and loaded[1]["answer"] == seqs[1][len(prompts[1]):]
    rows = replay_setting(model, heads, loaded, grown.depth, grown.top_k, grown.nodes)
    s = summarise("eagle", (grown.depth, grown.top_k, grown.nodes), rows, loaded, decoded=True)
    assert s["replay_agrees"] == 2
    for r in rows.values():
        assert r["grown"] <= r["oracle"] <= r["ceiling"]
    assert s["mean"]["grown_decoded"] > 1.0 and s["oracle_over_grown"]["questions"] == 2
    with pytest.raises(FileNotFoundError, match="evaluate@nothing"):
        load_records(tmp_path / "nothing", "baseline")
