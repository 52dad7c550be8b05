"""Draft heads with prompt lookup merged in: the heads' tree plus the context's n-gram continuation as one branch.

    lookup = {"num_tokens": 8, "max_ngram": 3, "min_ngram": 2, "tokens_per_ngram": 3}
    drafter = make_drafter({"kind": "heads_lookup", "tree": tree, "lookup": lookup}, heads=heads)
    drafter = make_drafter({"kind": "heads_lookup", "tree": tree16, "lookup": lookup, "step_cost": costs},
                           heads=heads)                                               # cut per step

Why: prompt lookup wins where the answer copies the context (MT-Bench extraction: a 3-gram match is followed
by the right token most of the time), the heads win everywhere else; on a CPU the verify step has room for
both in one forward. Each step the heads draft their tree and prompt lookup its chain (models/engine/
prompt_lookup.py); the chain is walked down the heads' tree from the root while its tokens equal a drafted
child's, and what is left of it hangs below the last such node as a branch of its own. One forward verifies
the union, so every acceptance rule that does not read the heads' q (greedy, typical, top-k drafts under
lossless sampling: each child a point mass) stays what it is: greedy output equals the baseline's. Under
lossless sampling with sampled heads' drafts, a node's drawn children keep their q and the lookup child
(the last, by rank) is tried after them as a point mass (models/engine/acceptance.py), which is exact for
whatever residual the drawn children leave; the union is then not cut (the rule needs every draw).

With step_cost (conf/tree/cut_pld.yaml) the union is cut like tree=cut (drafters/cut.py): a heads
node's probability is the heads' own along its path; a lookup node j tokens below the root has r_n ** j, r_n
the running rate (Laplace-smoothed) at which prompt lookup's tokens after an n-gram match were right in this
answer so far; a node both propose has the larger of the two.

Branch nodes are named in the merged TreeSpec by the rank `top_k` (one past the heads' ranks), which no head
proposes; the heads draft on their own tree only, the merged buffers serve verification and acceptance.
"""
from __future__ import annotations

from dataclasses import replace

import functools

import torch

from models.engine.drafters.base import Draft, DraftContext
from models.engine.drafters.cut import checked_step_costs, cut_by_cost
from models.engine.drafters.prompt_lookup import PromptLookupDrafter
from models.engine.drafters.tree import tree_drafter
from models.engine.trees import GrownTree, TreeBuffers, TreeSpec

__all__ = ["LookupBranchDrafter", "merge_chain", "merged_q", "with_branch"]


def merge_chain(children: list[list[int]], tokens: list[int], chain: list[int]) -> tuple[list[int], int]:
    """Walk `chain` down a drafted tree from the root (children[i]: node i's children; tokens[i]: its token).
    -> (the nodes it runs through, root excluded; how many chain tokens they cover). The rest of the chain
    is new: it hangs below the last of those nodes (the root when none)."""
    through, node = [], 0
    for tok in chain:
        node = next((c for c in children[node] if tokens[c] == tok), -1)
        if node < 0:
            break
        through.append(node)
    return through, len(through)


@functools.lru_cache(maxsize=256)
def with_branch(spec: TreeSpec, attach: int, k: int) -> tuple[TreeBuffers, torch.Tensor]:
    """Buffers of `spec`'s tree with a chain of k lookup nodes below its node `attach` (node order of
    TreeBuffers), and src: merged node i is entry src[i] of [spec's node tokens..., the k chain tokens].
    The branch's nodes carry rank spec.top_k, which no head proposes."""
    nodes = [()] + sorted(spec.paths, key=lambda p: (len(p), p))                # node i of spec's buffers
    branch = [nodes[attach] + (spec.top_k,) + (0,) * j for j in range(k)]
    merged = TreeSpec(f"{spec.name}+lookup{k}", spec.paths + tuple(branch), spec.top_k + 1)
    index = {p: i for i, p in enumerate(nodes)} | {p: len(nodes) + j for j, p in enumerate(branch)}
    order = [()] + sorted(merged.paths, key=lambda p: (len(p), p))
    return TreeBuffers.build(merged), torch.tensor([index[p] for p in order])


class LookupBranchDrafter:
    """The heads' tree (TreeDrafter, uncut) with prompt lookup's chain merged in; step_cost: cut the union per
    step by expected tokens per cost (see the module docstring); sampled heads' drafts keep the union uncut."""

    PRIOR = (1.0, 2.0)             # Laplace: a rate of 1/2 before any evidence

    def __init__(self, heads, tree: TreeSpec | TreeBuffers | GrownTree, lookup: PromptLookupDrafter,
                 step_cost: list[float] | None = None):
        self.step_cost = checked_step_costs(step_cost)
        if isinstance(tree, GrownTree) and self.step_cost is not None:
            raise ValueError(f"grown tree {tree.name!r} with cut_by_cost: a grown tree picks its nodes itself")
        self.tree = tree_drafter(heads, tree, want_probs=self.step_cost is not None)   # uncut: the union is cut here
        self.lookup = lookup
        self.stats: dict[int, list[float]] = {}                             # n-gram length -> [right, tried]
        self._pending: tuple[int, list[int]] | None = None                  # last step's (n, chain)
        self._accepted: list[int] = []                                      # last step's accepted drafts
        self.taps = self.tree.taps                                          # what the heads' proposer reads
        self.cutting = self.step_cost is not None

    # -- state ---------------------------------------------------------------------------------
    def start(self, ctx: DraftContext) -> None:
        self.cutting = self.step_cost is not None and not ctx.sampling.samples_drafts
        self.tree.start(replace(ctx, on_device=False))     # its drafts' buffers are merged with the lookup's
        self.lookup.start(ctx)
        self._pending, self._accepted = None, []

    def advance(self, hidden: torch.Tensor, tokens: list[int], position: int) -> None:
        self.tree.advance(hidden, tokens, position)
        self.lookup.advance(hidden, tokens, position)
        self._accepted = list(tokens[1:])

    def rewind(self, position: int) -> None:
        self.tree.rewind(position)
        self.lookup.rewind(position)
        self._pending, self._accepted = None, []

    def rate(self, n: int) -> float:
        """How often a lookup token after an n-gram match was right in this answer so far (smoothed)."""
        right, tried = self.stats.get(n, (0.0, 0.0))
        return (right + self.PRIOR[0]) / (tried + self.PRIOR[1])

    def _score(self, root: int) -> None:
        """Last step's chain against what came out: its accepted drafts, then the bonus token (this root)."""
        if self._pending is None:
            return
        n, chain = self._pending
        known = [*self._accepted, root]
        right = 0
        while right < min(len(chain), len(known)) and chain[right] == known[right]:
            right += 1
        tried = right if right == len(known) else min(len(chain), right + 1)
        s = self.stats.setdefault(n, [0.0, 0.0])
        s[0] += right
        s[1] += tried
        self._pending = None

    # -- drafting ------------------------------------------------------------------------------
    def draft(self, root: int, max_depth: int) -> Draft:
        self._score(root)
        heads = self.tree.draft(root, max_depth)
        buf, tokens, draft_q = heads.buf, heads.tokens, heads.draft_q
        lookup = self.lookup.draft(root, max_depth)
        chain, n = lookup.tokens[1:].tolist(), lookup.extras["ngram"]
        if chain:
            self._pending = (n, chain)
        through, covered = merge_chain(buf.children, tokens.tolist(), chain)
        rest = chain[covered:]
        attach = through[-1] if through else 0
        probs = None
        if self.cutting:
            probs = heads.node_probs.clone()                                 # [N] the heads' own, root 1
            r = self.rate(n) if chain else 0.0
            for j, node in enumerate(through, start=1):
                probs[node] = max(float(probs[node]), r ** j)
            probs = torch.cat([probs, torch.tensor([r ** (covered + k) for k in range(1, len(rest) + 1)])])
        if rest:
            merged, src = with_branch(buf.spec, attach, len(rest))
            draft_q = None if draft_q is None else merged_q(draft_q, buf.children, src.tolist())
            buf, tokens = merged, torch.cat([tokens, tokens.new_tensor(rest)])[src]
            probs = None if probs is None else probs[src]
        if probs is not None and buf.num_tokens > 1:
            keep = cut_by_cost(probs.tolist(), self.step_cost)
            if len(keep) < buf.num_tokens:
                buf, tokens, probs = buf.subtree(keep), tokens[list(keep)], probs[list(keep)]
        return Draft(buf, tokens, draft_q, probs, extras={"ngram": n})


def merged_q(heads_q, heads_children: list[list[int]], src: list[int]):
    """The sampled heads' draft_q on the merged tree (node i is the heads' node src[i], or a lookup node when
    src[i] is past the heads' nodes): a heads' node's q with the number of its children q drew (the lookup
    child after them is a point mass); a lookup node's child is a point mass (None)."""
    def q(node: int):
        h = src[node]
        return (heads_q(h), len(heads_children[h])) if h < len(heads_children) else None
    return q


def build(spec: dict, heads=None, **_) -> LookupBranchDrafter:
    """spec: tree, lookup (PromptLookupDrafter's settings, a mapping), step_cost (optional); heads: DraftHeads."""
    if heads is None or spec.get("tree") is None:
        raise ValueError("a heads_lookup drafter needs heads=... and a tree in its spec")
    lookup = PromptLookupDrafter(**dict(spec.get("lookup") or {}))
    return LookupBranchDrafter(heads, spec["tree"], lookup, spec.get("step_cost"))
