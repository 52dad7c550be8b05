"""How much could a per-step cut of the draft tree gain? Replay recorded greedy steps under cut policies.

    rec = RecordingDrafter(TreeDrafter(heads, tree, want_probs=True))   # the whole tree, never cut
    generate(model, tok, ids, drafter=rec)                              # greedy: output = the baseline's
    steps = rec.steps                                                   # [CutStep]: probs, accepted per node
    table = replay_policies(steps, step_cost)                           # {policy: ReplayResult}

A greedy verify step accepts node i of the tree iff its path equals the base model's greedy continuation,
whatever else the tree holds. So one decode of the whole tree records, per step, which nodes would be
accepted in ANY ancestor-closed subtree S of it: that step would emit |S & accepted| tokens (the root
counts as the bonus token) and cost step_cost[|S| - 1] (the verify step's latency profile, relative to a
1-token step). A policy picks S per step; its figure is tokens / verify cost, relative to the baseline,
before drafting (the same drafts for every policy) and bookkeeping. Policies:
  fixed-k      the k nodes accepted most often on the OTHER groups (questions): a fixed k-node tree
  cut          drafters.cut_by_cost on the heads' own probabilities (tree=cut)
  recalibrated cut_by_cost on the heads' probabilities mapped to how often nodes of that probability
               were accepted on the other groups (binned, monotone): a cut with calibrated probabilities
  oracle       exactly the accepted nodes: the ceiling of any cut (not a decoder)
Groups are left out one at a time, so no policy is fitted on the step it is scored on.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from models.engine.drafting import Draft, DraftContext, cut_by_cost


@dataclass
class CutStep:
    probs: np.ndarray        # [N] heads' probability of each node along its path (root 1)
    accepted: np.ndarray     # [N] bool: node i's path is the base model's greedy continuation (root True)
    group: int               # what leave-one-out holds out together (the question)


def accepted_nodes(tokens: list[int], parent: list[int], depth: list[int], accepted_path: list[int]) -> np.ndarray:
    """Tree tokens [N] (node 0 = root), parent [N] (-1 for the root), depth [N], and the tokens the step
    accepted (root first, then the accepted drafts) -> [N] bool, node i accepted. Nodes are ordered parents
    before children, as TreeBuffers orders them."""
    acc = np.zeros(len(tokens), dtype=bool)
    acc[0] = True
    for i in range(1, len(tokens)):
        d = depth[i]
        acc[i] = acc[parent[i]] and d < len(accepted_path) and tokens[i] == accepted_path[d]
    return acc


class RecordingDrafter:
    """A StepDrafter around a TreeDrafter that records every step's CutStep (greedy decoding, whole tree)."""

    def __init__(self, tree_drafter, group: int = 0):
        if tree_drafter.step_cost is not None:
            raise ValueError("record the whole tree: give RecordingDrafter a TreeDrafter without step_cost")
        self.inner, self.group, self.steps = tree_drafter, group, []
        self.full_size = tree_drafter.buf.num_tokens
        self._pending = None

    def start(self, ctx: DraftContext) -> None:
        self.inner.start(ctx)

    def draft(self, root: int, max_depth: int) -> Draft:
        draft = self.inner.draft(root, max_depth)
        if draft.node_probs is None:
            raise ValueError("record a TreeDrafter built with want_probs=True (greedy drafts)")
        full = draft.buf.num_tokens == self.full_size           # steps near the token limit are cut by depth
        self._pending = (draft.buf, draft.tokens.tolist(), draft.node_probs.tolist()) if full else None
        return draft

    def advance(self, hidden: torch.Tensor, tokens: list[int], position: int) -> None:
        if self._pending is not None:
            buf, tree_tokens, probs = self._pending
            acc = accepted_nodes(tree_tokens, buf.parent.tolist(), buf.depth.tolist(), list(tokens))
            self.steps.append(CutStep(np.asarray(probs, dtype=float), acc, self.group))
        self.inner.advance(hidden, tokens, position)

    def rewind(self, position: int) -> None:
        self.inner.rewind(position)


@dataclass
class ReplayResult:
    tokens_per_step: float
    relative_speed: float    # tokens / verify cost, over the baseline's 1 token per 1-token step (before drafting)
    mean_nodes: float        # drafted nodes verified per step


def replay(steps: list[CutStep], step_cost: list[float], choose) -> ReplayResult:
    """choose(step) -> kept node indices (root included, ancestor-closed) -> the policy's figures."""
    tokens = cost = nodes = 0.0
    for s in steps:
        keep = list(choose(s))
        if 0 not in keep or len(keep) > len(step_cost):
            raise ValueError(f"a policy must keep the root and at most {len(step_cost)} tokens, got {keep}")
        tokens += s.accepted[keep].sum()
        cost += step_cost[len(keep) - 1]
        nodes += len(keep) - 1
    n = max(len(steps), 1)
    return ReplayResult(tokens / n, tokens / cost if cost else 0.0, nodes / n)


def most_accepted(steps: list[CutStep], k: int) -> list[int]:
    """The root and the k nodes accepted most often in `steps` (a child is never accepted more often than its
    parent, so ties broken by index keep the set ancestor-closed)."""
    freq = np.mean([s.accepted for s in steps], axis=0)
    order = sorted(range(1, len(freq)), key=lambda i: (-freq[i], i))
    return sorted([0, *order[:k]])


def probability_map(steps: list[CutStep], bins: int = 10):
    """p -> how often nodes whose heads' probability fell in p's quantile bin were accepted in `steps`
    (non-decreasing in p, so a child still never outranks its parent)."""
    p = np.concatenate([s.probs[1:] for s in steps])
    a = np.concatenate([s.accepted[1:] for s in steps])
    edges = np.quantile(p, np.linspace(0, 1, bins + 1))[1:-1]
    which = np.searchsorted(edges, p, side="right")
    rate = np.array([a[which == b].mean() if (which == b).any() else 0.0 for b in range(bins)])
    rate = np.maximum.accumulate(rate)
    return lambda q: np.concatenate([[1.0], rate[np.searchsorted(edges, q[1:], side="right")]])


def replay_policies(steps: list[CutStep], step_cost: list[float], max_fixed: int = 8) -> dict[str, ReplayResult]:
    """Every policy of the module docstring on the same steps (leave-one-group-out fits)."""
    if not steps:
        raise ValueError("no recorded steps to replay")
    groups = sorted({s.group for s in steps})
    if len(groups) < 2:
        raise ValueError(f"leave-one-out needs steps from 2 or more groups (questions), got {groups}")
    others = {g: [s for s in steps if s.group != g] for g in groups}
    out = {}
    for k in range(min(max_fixed, len(steps[0].probs) - 1, len(step_cost) - 1) + 1):
        fixed = {g: most_accepted(others[g], k) for g in groups}
        out[f"fixed-{k}"] = replay(steps, step_cost, lambda s: fixed[s.group])
    out["cut"] = replay(steps, step_cost, lambda s: cut_by_cost(s.probs.tolist(), step_cost))
    maps = {g: probability_map(others[g]) for g in groups}
    out["recalibrated"] = replay(steps, step_cost,
                                 lambda s: cut_by_cost(maps[s.group](s.probs).tolist(), step_cost))
    out["oracle"] = replay(steps, step_cost, lambda s: np.flatnonzero(s.accepted)[:len(step_cost)])
    return out
