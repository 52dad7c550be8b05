"""pytest tests/test_cut_replay.py: the per-step cut replay (models/measure/cut_replay.py, pipelines/bench/cut.py).

What acceptance a node gets from the step's accepted tokens; every policy's figures on hand-counted steps,
with leave-one-group-out fits; the recorder on a real (tiny) decode with oracle heads, whose accepted nodes are
known, checked against the decoder's own accepted lengths and the baseline's tokens.
"""
import numpy as np
import pytest
import torch

from models.base import build_tiny_model
from models.engine.decoding import generate
from models.engine.drafting import TreeDrafter
from models.engine.trees import tree_from_config
from models.measure.cut_replay import (CutStep, RecordingDrafter, accepted_nodes, most_accepted, probability_map,
                                       replay, replay_policies)
from tests.test_decoding import OracleHeads, prompt_ids

pytestmark = pytest.mark.usefixtures("one_thread")


def test_accepted_nodes_follow_the_accepted_path():
    # root r; depth 1: a (rank 0), b (rank 1); depth 2: c below a
    tokens, parent, depth = [7, 1, 2, 3], [-1, 0, 0, 1], [0, 1, 1, 2]
    assert accepted_nodes(tokens, parent, depth, [7]).tolist() == [True, False, False, False]
    assert accepted_nodes(tokens, parent, depth, [7, 1]).tolist() == [True, True, False, False]
    assert accepted_nodes(tokens, parent, depth, [7, 1, 3]).tolist() == [True, True, False, True]
    assert accepted_nodes(tokens, parent, depth, [7, 2]).tolist() == [True, False, True, False]
    # c's token after the wrong parent is not accepted, even though it matches depth 2
    assert accepted_nodes(tokens, parent, depth, [7, 2, 3]).tolist() == [True, False, True, False]


def step(accepted, probs, group):
    return CutStep(np.array(probs, dtype=float), np.array(accepted, dtype=bool), group)


# a chain r -> a -> b; costs of steps of 1, 2, 3 tokens
COST = [1.0, 1.0, 1.5]
STEPS = [step([1, 1, 1], [1, .9, .8], 0), step([1, 1, 0], [1, .9, .5], 0),
         step([1, 1, 0], [1, .8, .4], 1), step([1, 0, 0], [1, .3, .1], 1),
         step([1, 0, 0], [1, .2, .1], 2), step([1, 1, 1], [1, .7, .6], 2)]


def test_replay_counts_tokens_and_cost_of_the_kept_nodes():
    whole = replay(STEPS, COST, lambda s: [0, 1, 2])
    # tokens 3 + 2 + 2 + 1 + 1 + 3 = 12 over 6 steps, cost 6 x 1.5
    assert whole.tokens_per_step == pytest.approx(2.0) and whole.relative_speed == pytest.approx(12 / 9)
    assert whole.mean_nodes == 2
    root = replay(STEPS, COST, lambda s: [0])
    assert (root.tokens_per_step, root.relative_speed, root.mean_nodes) == (1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="keep the root"):
        replay(STEPS, COST, lambda s: [1])


def test_policies_fit_on_the_other_groups_only():
    table = replay_policies(STEPS, COST)
    assert list(table) == ["fixed-0", "fixed-1", "fixed-2", "cut", "recalibrated", "oracle"]
    # node 1 is accepted 4 times of 6: kept by fixed-1 in every fold; tokens 2+2+2+1+1+2 = 10, cost 6
    assert table["fixed-1"].tokens_per_step == pytest.approx(10 / 6)
    assert table["fixed-1"].relative_speed == pytest.approx(10 / 6)
    # oracle: the accepted nodes, 3 + 2 + 2 + 1 + 1 + 3 tokens at cost 1.5, 1, 1, 1, 1, 1.5
    assert table["oracle"].relative_speed == pytest.approx(12 / 7)
    assert most_accepted(STEPS, 1) == [0, 1] and most_accepted(STEPS, 0) == [0]
    with pytest.raises(ValueError, match="2 or more groups"):
        replay_policies([s for s in STEPS if s.group == 0], COST)


def test_probability_map_is_an_acceptance_rate_and_monotone():
    steps = [step([1, 1], [1, p], 0) if p > .5 else step([1, 0], [1, p], 0) for p in np.linspace(.05, .95, 40)]
    f = probability_map(steps, bins=4)
    low, high = f(np.array([1, .1])), f(np.array([1, .9]))
    assert low[0] == 1.0 and low[1] == 0.0 and high[1] == 1.0
    grid = f(np.concatenate([[1.0], np.linspace(0, 1, 50)]))[1:]
    assert (np.diff(grid) >= 0).all()


def test_recording_drafter_records_what_the_decoder_accepted():
    """Oracle heads right at depth 1 and never at depth 2: every full step accepts exactly node 1's chain, so the
    recorded acceptance must agree with the decoder's accept_lengths, and the answer with the baseline's."""
    model, tok = build_tiny_model(arch="llama", seed=3)
    ids = prompt_ids(tok)
    base = generate(model, tok, ids, max_new_tokens=30, stop_token_ids=[])
    seq = ids + base.new_tokens
    heads = OracleHeads(model, seq, "hydra", num_heads=2, ranks=(0, None))
    tree = tree_from_config({"kind": "paths", "top_k": 2, "paths": [[0], [1], [0, 0], [1, 0]]})
    rec = RecordingDrafter(TreeDrafter(heads, tree, want_probs=True), group=5)
    res = generate(model, tok, ids, rec, max_new_tokens=30, stop_token_ids=[])
    assert res.new_tokens == base.new_tokens
    full = res.accept_lengths
    assert len(rec.steps) >= len(full) - 2 and rec.steps            # steps cut by the token limit are left out
    for s, n in zip(rec.steps, full):
        assert s.accepted.sum() == n and s.group == 5
        assert s.accepted.tolist() == [True, True, False, False, False]
        assert s.probs[0] == 1.0 and 0 < s.probs[1] <= 1 and (s.probs[3:] <= s.probs[1:3]).all()
    with pytest.raises(ValueError, match="without step_cost"):
        RecordingDrafter(TreeDrafter(heads, tree, step_cost=[1.0, 1.0, 1.1, 1.2, 1.3]))
