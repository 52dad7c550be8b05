"""Cutting a drafted tree per step to the nodes that pay for their verify cost (tree=cut, cut_pld)."""
from __future__ import annotations


def checked_step_costs(step_cost) -> list[float] | None:
    """step_cost as floats (None stays None); a ValueError unless they are positive costs of steps of 1, 2, ... tokens."""
    if step_cost is None:
        return None
    costs = [float(c) for c in step_cost]
    if len(costs) < 1 or min(costs) <= 0:
        raise ValueError(f"step_cost must list positive costs of steps of 1, 2, ... tokens; got {step_cost}")
    return costs


def cut_by_cost(node_probs: list[float], step_cost: list[float]) -> tuple[int, ...]:
    """The nodes worth verifying: node_probs[i] = the drafter's probability that node i is accepted (the product
    of its probabilities along its path; node 0 = root, 1), step_cost[m - 1] = the cost of a step verifying m
    tokens. Keeps the n most probable nodes, n maximising expected tokens per cost (1 + their probabilities) /
    step_cost[n]; -> node indices, root first, rising. A child is never more probable than its parent, so every
    kept node's parent is kept (ties go to the lower index: the parent)."""
    order = sorted(range(1, len(node_probs)), key=lambda i: (-node_probs[i], i))
    best_n, best, gain = 0, 1.0 / step_cost[0], 1.0
    for n, i in enumerate(order[:len(step_cost) - 1], start=1):
        gain += node_probs[i]
        if gain / step_cost[n] > best:
            best_n, best = n, gain / step_cost[n]
    return tuple(sorted([0, *order[:best_n]]))
