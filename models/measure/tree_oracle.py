"""What the tree grown per step leaves on the table: its replay along the base's greedy answers beside an oracle that
keeps, of the same candidates, exactly the nodes on the base's path, with the same node budget.

    replay = replay_grown(model, heads, seqs, starts, top_k, depth)   # grown_calibration: one growth per position
    grown = accepted_drafts(replay, levels, nodes)                    # the decoder's drafts: the best `nodes` by score
    oracle = oracle_drafts(replay, levels, nodes)                     # the path's nodes, at most `nodes` of them
    ceiling = candidate_drafts(replay, levels)                        # every candidate kept: no budget
    steps = walk_steps(grown)                                         # tokens per step, as decoding visits positions

At a position the grown tree accepts the longest prefix of the base's continuation that its kept nodes hold. An
oracle of the same size keeps the path's own nodes (a chain, ancestors first), so it accepts as deep as the
candidates reach down the path, cut at `nodes`; every candidate kept gives the ceiling of that growth. A gap
between grown and oracle is the ranking's (the draft's scores put other nodes first); a gap between the oracle and
the target is the drafts' (the base's token is not among the top_k children, or the tree is too shallow).
`walk_steps` jumps by what each step emits, so a policy's mean is over the positions it would decode from
(tests/test_grown_pipeline.py checks the replay's steps against the decoder's own).
"""
from __future__ import annotations

import numpy as np

from models.measure.grown_calibration import GrownReplay


def candidate_drafts(replay: GrownReplay, levels: int) -> np.ndarray:
    """[positions]: how deep down the base's path the candidates of the first `levels` levels reach."""
    return np.array([sum(1 for lv in path if lv <= levels) for path in replay.path_levels], dtype=np.int64)


def oracle_drafts(replay: GrownReplay, levels: int, nodes: int) -> np.ndarray:
    """[positions]: drafts accepted by a tree of `nodes` drafts chosen in hindsight from the same candidates."""
    if nodes < 1 or levels < 1:
        raise ValueError(f"oracle_drafts: levels={levels} and nodes={nodes} must both be >= 1")
    return np.minimum(candidate_drafts(replay, levels), nodes)


def walk_steps(drafts: np.ndarray) -> list[int]:
    """Tokens each decoding step emits when the step at position i accepts drafts[i] drafts (1 + that), starting at
    position 0 and moving on by what each step emits."""
    steps, i = [], 0
    while i < len(drafts):
        steps.append(1 + int(drafts[i]))
        i += steps[-1]
    return steps


def steps_agree(replayed: list[int], decoded: list[int], tail: int) -> bool:
    """The replayed steps equal the decoder's up to the last `tail` tokens of the answer (where the decoder's steps
    are cut by the token budget and the replay's by the end of the sequence)."""
    limit, n, covered = sum(decoded) - tail, 0, 0
    while n < min(len(replayed), len(decoded)) and covered + decoded[n] <= limit:
        covered += decoded[n]
        n += 1
    return replayed[:n] == decoded[:n]
