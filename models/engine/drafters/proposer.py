"""The proposer protocol: what drafts a tree's tokens from a model (draft heads, EAGLE's layer, a draft model),
the one place children are selected from its scores, and the walk that drafts a given tree depth by depth.

    proposer = proposer_for(heads)            # the heads' method's proposer: heads.method.proposer(heads)
    proposer.start(ctx)                       # DraftContext after the prefill
    tokens, draft_q, node_probs = draft_tree(proposer, root, buf, sampling, generator, want_probs=True)
    proposer.advance(hidden, tokens, position)            # the accepted path, as StepDrafter.advance

A proposer scores a frontier: given tree nodes of one depth (their tokens, paths, parents and ancestors) it
returns the draft's logits over its vocabulary for each node's children ([R, Vd]; [1, Vd] when every node of
the frontier gets the same ones, as Medusa's heads, which read no path). select_children turns those into
children: the top-k, or k draws without replacement from the warped distribution q (lossless sampling with
draft="sample"), with their log-probabilities. A fixed tree expands the nodes its topology names (draft_tree);
a tree grown per step expands the best ones through the same calls. The engine never imports a method: the heads it
is handed carry theirs (DraftHeads.method, models/shared/method.py), whose proposer factory it calls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from models.engine.acceptance import SamplingConfig, warp_probs
from models.engine.drafters.base import DraftContext
from models.engine.trees import TreeBuffers


@dataclass(frozen=True)
class Frontier:
    """Nodes of one depth of the tree being drafted, whose children are asked for. Shapes: R frontier nodes,
    N nodes drafted so far (node 0 the root)."""
    depth: int                    # the nodes' depth (root 0); their children are at depth + 1
    nodes: torch.Tensor           # [R] long, node indices
    parents: torch.Tensor         # [R] long, each node's parent (-1 for the root)
    paths: torch.Tensor           # [R, depth + 1] long, tokens root .. node
    ancestors: torch.Tensor       # [R, N] bool, each node's ancestors and itself
    tokens: torch.Tensor          # [N] long, every drafted node's token

    def __post_init__(self):
        R = self.nodes.numel()
        if self.paths.shape != (R, self.depth + 1) or self.ancestors.shape[0] != R or self.parents.numel() != R:
            raise ValueError(f"frontier of {R} nodes at depth {self.depth}: paths {tuple(self.paths.shape)}, "
                             f"ancestors {tuple(self.ancestors.shape)}, parents {self.parents.numel()} do not match")


class Proposer(Protocol):
    taps: tuple[int, ...]                 # base states it reads beside the final one (models/engine/taps.py)
    draft_ids: torch.Tensor | None        # [Vd] token id of each score column; None: the full vocabulary
    vocab_size: int                       # the base's vocabulary (for q over the full vocabulary)
    max_depth: int | None                 # the deepest tree it can draft (draft heads: their number); None: any

    def start(self, ctx: DraftContext) -> None: ...
    def advance(self, hidden: torch.Tensor, tokens: list[int], position: int) -> None: ...
    def rewind(self, position: int) -> None: ...
    def begin(self, root: int, depth: int) -> None: ...          # a new tree below root, at most depth deep
    def scores(self, frontier: Frontier) -> torch.Tensor: ...    # [R or 1, Vd] logits of the nodes' children
    # optional: child_accept(frontier) -> [R], P(a node's top child is accepted), read in place of the top child's
    # draft probability by the per-step cut (DSpark's confidence head)
    def end(self) -> None: ...                                   # the tree is drafted: drop what it added


@dataclass
class Children:
    """select_children's result for R rows: picks [R, k] (columns of the scores), q [R, Vd] the distribution they
    were drawn from (sampled drafts) or None, logp [R, k] their log-probabilities under softmax(scores) (top-k
    drafts, when asked) or None."""
    picks: torch.Tensor
    q: torch.Tensor | None = None
    logp: torch.Tensor | None = None


def draw_without_replacement(logits: torch.Tensor, k: int, sampling: SamplingConfig,
                             generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, Vd] -> (k draws per row from q = warp_probs(logits, sampling) without replacement, in the order
    drawn [R, k], q [R, Vd]): the exponential race (Gumbel top-k), one random number per token."""
    q = warp_probs(logits, sampling)
    race = torch.empty_like(q).exponential_(generator=generator)
    return torch.topk(q / race, k, dim=-1).indices, q


def select_children(logits: torch.Tensor, k: int, sampling: SamplingConfig, generator: torch.Generator | None = None,
                    want_logp: bool = False) -> Children:
    """k children per row of logits [R, Vd]: the top k (with their log-softmax when want_logp), or with
    sampling.samples_drafts k draws without replacement from the warped distribution (with it)."""
    if k > logits.shape[-1]:
        raise ValueError(f"the tree asks for {k} ranks per node but the draft scores only {logits.shape[-1]} "
                         "tokens (draft_vocab_size): use a tree with fewer ranks or a larger draft vocabulary")
    if sampling.samples_drafts:
        picks, q = draw_without_replacement(logits, k, sampling, generator)
        return Children(picks, q=q)
    top = torch.topk(logits, k, dim=-1)
    logp = top.values - torch.logsumexp(logits, dim=-1, keepdim=True) if want_logp else None
    return Children(top.indices, logp=logp)


def full_vocabulary_q(q: torch.Tensor, draft_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """q [Vd] over a draft vocabulary (token ids draft_ids [Vd]; None: the full one) -> [V], zero outside it."""
    if draft_ids is None:
        return q
    return q.new_zeros(vocab_size).index_copy_(0, draft_ids.to(q.device), q)


def level_frontier(buf: TreeBuffers, d: int, tokens: torch.Tensor) -> Frontier:
    """The parents of buf.levels[d] (the nodes at depth d that have children) as a frontier, its index tensors on
    the tokens' device."""
    level = buf.levels_on(tokens.device)[d]
    nodes = level.parents
    return Frontier(d, nodes, buf.on("parent", tokens.device)[nodes], tokens[level.parent_paths],
                    buf.on("tree_mask", tokens.device)[0, 0][nodes], tokens)


def draft_tree(proposer: Proposer, root: int | torch.Tensor, buf: TreeBuffers, sampling: SamplingConfig,
               generator: torch.Generator | None = None, want_probs: bool = False):
    """The tokens of the fixed tree `buf` below `root` (a token id, or a one-element tensor on the proposer's device
    holding it: a replayed CUDA graph reads it there), one proposer call per depth -> (tokens [N] (node 0 the
    root), draft_q(node) -> q [V] of its children when they were sampled, else None, node_probs [N]: the product
    of the draft's probabilities root -> node, with want_probs and top-k drafts, else None)."""
    device = proposer_device(proposer)
    tokens = torch.empty(buf.num_tokens, dtype=torch.long, device=device)
    if isinstance(root, torch.Tensor):
        tokens[:1].copy_(root.reshape(1))
    else:
        tokens[0] = root
    probs = torch.ones(buf.num_tokens) if want_probs and not sampling.samples_drafts else None
    q_of = {}                                                              # parent node -> q [Vd]
    accept = getattr(proposer, "child_accept", None) if probs is not None else None
    proposer.begin(root, len(buf.levels))
    try:
        for d, (level, here) in enumerate(zip(buf.levels, buf.levels_on(device))):
            frontier = level_frontier(buf, d, tokens)
            logits = proposer.scores(frontier)                                   # [P or 1, Vd]
            kids = select_children(logits, level.num_ranks, sampling, generator, want_logp=probs is not None)
            slot = here.parent_slot if logits.shape[0] > 1 else torch.zeros_like(here.parent_slot)
            tokens[here.nodes] = to_token_ids(proposer, kids.picks[slot, here.ranks])
            if probs is not None:
                parent_p = probs[buf.parent[level.nodes]]
                p = kids.logp[slot, here.ranks].exp().float().cpu()
                if accept is not None:       # the proposer's own estimate that a node's top child is accepted
                    top = accept(frontier).float().cpu()                         # [P]
                    first = here.ranks.cpu() == 0
                    p[first] = top[here.parent_slot.cpu()[first].clamp(max=top.numel() - 1)]
                probs[level.nodes] = parent_p * p
            if kids.q is not None:
                q_of.update({int(p): kids.q[min(s, kids.q.shape[0] - 1)] for s, p in enumerate(level.parents)})
    finally:
        proposer.end()
    if not q_of:
        return tokens, None, probs
    return tokens, (lambda node: full_vocabulary_q(q_of[node], proposer.draft_ids, proposer.vocab_size)), probs


def draft_trees(proposers: list, roots: list[int], buf: TreeBuffers, sampling: SamplingConfig,
                generators: list) -> list[torch.Tensor]:
    """draft_tree for several sequences' proposers of one class on one tree (a batch: models/engine/batch.py), level
    by level together: where the class has begin_many and scores_many, one call a level scores every sequence's
    frontier; else each its own. Greedy or top-k drafts only (the children drawn from q and the node probabilities
    a cut reads stay with draft_tree) -> each sequence's tokens [N], node 0 its root."""
    device, cls = proposer_device(proposers[0]), type(proposers[0])
    tokens = [torch.empty(buf.num_tokens, dtype=torch.long, device=device) for _ in proposers]
    for t, root in zip(tokens, roots):
        t[0] = root
    begin_many, scores_many = getattr(cls, "begin_many", None), getattr(cls, "scores_many", None)
    if begin_many is not None:
        begin_many(proposers, roots, len(buf.levels))
    else:
        for p, root in zip(proposers, roots):
            p.begin(root, len(buf.levels))
    try:
        for d, (level, here) in enumerate(zip(buf.levels, buf.levels_on(device))):
            frontiers = [level_frontier(buf, d, t) for t in tokens]
            rows = scores_many(proposers, frontiers) if scores_many is not None else \
                [p.scores(f) for p, f in zip(proposers, frontiers)]
            for p, t, logits, g in zip(proposers, tokens, rows, generators):
                kids = select_children(logits, level.num_ranks, sampling, g)
                slot = here.parent_slot if logits.shape[0] > 1 else torch.zeros_like(here.parent_slot)
                t[here.nodes] = to_token_ids(p, kids.picks[slot, here.ranks])
    finally:
        for p in proposers:
            p.end()
    return tokens


def to_token_ids(proposer: Proposer, picks: torch.Tensor) -> torch.Tensor:
    return picks if proposer.draft_ids is None else proposer.draft_ids.to(picks.device)[picks]


def proposer_device(proposer: Proposer) -> torch.device:
    return getattr(proposer, "device", None) or torch.device("cpu")


def proposer_for(heads) -> Proposer:
    """The proposer of `heads` (a method's module): the factory of the Method the heads carry."""
    method = getattr(heads, "method", None)
    if method is None:
        raise ValueError(f"{type(heads).__name__} carries no method, so nothing says how it drafts: build heads with "
                         "models.methods.build_heads or load_heads, or hand the drafter a proposer")
    return method.proposer(heads)
