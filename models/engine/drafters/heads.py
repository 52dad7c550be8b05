"""Draft heads proposing the tokens of a given tree: one batched head call per depth (used by tree.py and
lookup_branch.py, which decide the tree).

    drafter = HeadsDrafter(heads, want_probs=True)
    drafter.start(prompt_hidden, sampling, generator)      # [T, h] base hidden states of the prompt
    tokens, draft_q, node_probs = drafter.draft(root, buffers)
        # tokens [N] (node 0 = root); draft_q(node) -> q [V] or None; node_probs [N] (want_probs) or None
    drafter.advance(hidden[path], position)                # after acceptance: the accepted nodes' hidden states

- Medusa: head k sees h_t only, so the proposals of one depth are the same for every parent:
  all heads run once on h_t (one LM-head product when the heads share the base LM head).
- Hydra: head d-1 sees h_t and the tokens of the path above the node (root x_{t+1} .. parent),
  so depth d is drafted from its parents' paths, all parents of depth d in one batch.
- Hydra++: like Hydra, with h_t taken from the prefix decoder layer run causally over the base
  hidden states. Its own KV cache only ever receives accepted positions (`advance`), so it
  holds exactly the accepted sequence and needs no rollback.
Proposals are the top-k ranks of each head, or (lossless sampling with draft="sample") draws
without replacement from the warped head distribution, by the exponential-race (Gumbel top-k) trick.
Heads with a draft vocabulary (DraftHeads.draft_ids, [Vd]) score those tokens only: ranks and draws are
taken over the Vd logits and mapped back to token ids, and a sampled node's q is the head's distribution
over the FULL vocabulary (zeros outside the draft vocabulary), as lossless speculative sampling needs.
"""
from __future__ import annotations

import torch

from models.engine.acceptance import SamplingConfig, warp_probs
from models.engine.drafters.base import AdvanceHistory
from models.engine.kv_cache import new_cache
from models.engine.projection import project
from models.heads import DraftHeads
from models.heads.families import get_family


def draw_without_replacement(logits: torch.Tensor, k: int, sampling: SamplingConfig,
                             generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, Vd] -> (k draws per row from q = warp_probs(logits, sampling) without replacement, in the order
    drawn [R, k], q [R, Vd]): the exponential race (Gumbel top-k), one random number per token."""
    q = warp_probs(logits, sampling)
    race = torch.empty_like(q).exponential_(generator=generator)
    return torch.topk(q / race, k, dim=-1).indices, q


def full_vocabulary_q(q: torch.Tensor, draft_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """q [Vd] over a draft vocabulary (token ids draft_ids [Vd]; None: the full one) -> [V], zero outside it."""
    if draft_ids is None:
        return q
    return q.new_zeros(vocab_size).index_copy_(0, draft_ids.to(q.device), q)


class HeadsDrafter:
    """want_probs: draft() also returns node_probs, the product of the heads' probabilities root -> node
    (greedy and typical drafts; the cost cuts and the cut replay read them)."""

    def __init__(self, heads, want_probs: bool = False):
        self.heads, self.want_probs = heads, want_probs
        self.sampling, self.generator = SamplingConfig(), None
        self.family = get_family(heads.config.family)
        # The Linear each head ends in ([h] -> [Vd]; the frozen base LM head or its draft-vocabulary rows when
        # shared), so that the drafter can run head k as head_hidden + project (fast for few rows); other
        # head objects: head_logits over the full vocabulary.
        self.linears = None
        self.draft_ids = heads.draft_ids if isinstance(heads, DraftHeads) else None   # [Vd]; None: full vocabulary
        if isinstance(heads, DraftHeads) and (heads.lm_heads is not None or heads.is_attached):   # attached or own heads
            self.linears = [heads.output_layer(k) for k in range(heads.config.num_heads)]
        self.prefix_cache = new_cache() if self.family.prefix_layer else None
        self.h = None                                   # [h] hidden state the heads read (position t)
        self.history = AdvanceHistory()                 # (positions seen, h then) of the last advances (rewind)
        self._node_probs = None                         # [N] while draft() runs with want_probs
        params = next(iter(heads.parameters()), None) if isinstance(heads, torch.nn.Module) else None
        self.dtype = None if params is None else params.dtype   # the heads' dtype (the base may run in bf16)

    # -- state ---------------------------------------------------------------------------------
    def start(self, hidden: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None = None,
              input_ids: torch.Tensor | None = None) -> None:
        """hidden: [T, h] base hidden states of the whole prompt (positions 0..T-1); sampling: how drafts are
        proposed (top-k ranks, or draws when sampling.samples_drafts, from `generator`); input_ids: unused (the
        heads read hidden states only)."""
        self.sampling, self.generator = sampling, generator
        self.prefix_cache = new_cache() if self.family.prefix_layer else None
        self.history.clear()
        self.advance(hidden, 0)

    def advance(self, hidden: torch.Tensor, position: int, tokens: list[int] | None = None) -> None:
        """hidden: [m, h] base hidden states of newly accepted positions position..position+m-1 (tokens: unused)."""
        if self.prefix_cache is None:
            h = hidden[-1]
        else:
            pos = torch.arange(position, position + hidden.shape[0], device=hidden.device).unsqueeze(0)
            h = self.heads.prefix_forward(hidden.unsqueeze(0), pos, cache=self.prefix_cache)[0, -1]
        self.h = h if self.dtype is None else h.to(self.dtype)
        self.history.push(position + hidden.shape[0], self.h)

    def rewind(self, position: int) -> None:
        """Back to the state after the first `position` positions: one of the last advances' ends."""
        self.h = self.history.back_to(position)
        if self.prefix_cache is not None:
            self.prefix_cache.crop(position - self.prefix_cache.get_seq_length())

    # -- proposals -----------------------------------------------------------------------------
    def pick(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """logits [R, Vd] -> (proposed token ids [R, k], warped q [R, Vd] when proposals are sampled, else None,
        the heads' softmax probability of each proposal [R, k] with want_probs, else None)."""
        if k > logits.shape[-1]:
            raise ValueError(f"the tree asks for {k} ranks per node but the heads score only {logits.shape[-1]} "
                             "tokens (draft_vocab_size): use a tree with fewer ranks or a larger draft vocabulary")
        probs = None
        if not self.sampling.samples_drafts:
            top = torch.topk(logits, k, dim=-1)
            picks, q = top.indices, None
            if self.want_probs:                     # softmax at the top-k: exp(l - logsumexp(l))
                probs = (top.values - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
        else:
            picks, q = draw_without_replacement(logits, k, self.sampling, self.generator)
        return (picks if self.draft_ids is None else self.draft_ids[picks]), q, probs

    def _full_q(self, q: torch.Tensor) -> torch.Tensor:
        return full_vocabulary_q(q, self.draft_ids, self.heads.config.vocab_size)

    def head_logits(self, k: int, hidden: torch.Tensor, path: torch.Tensor | None = None) -> torch.Tensor:
        """Head k's logits over the draft vocabulary: hidden [R, h], path [R, k+1] -> [R, Vd], with the fast projection."""
        if self.linears is None:
            return self.heads.head_logits(k, hidden, path)
        return project(self.linears[k], self.heads.head_hidden(k, hidden, path))

    def note_probs(self, level, probs: torch.Tensor) -> None:
        """After pick for one depth: probs [P, R] of its proposals -> node_probs of the level's nodes."""
        if self._node_probs is not None and probs is not None:
            parent_p = self._node_probs[level.parents[level.parent_slot]]
            self._node_probs[level.nodes] = parent_p * probs[level.parent_slot, level.ranks].float().cpu()

    def all_heads_logits(self, depth: int) -> torch.Tensor:
        """Heads 0..depth-1 on h_t alone (no path: Medusa) -> [depth, Vd]."""
        if self.linears is not None and self.heads.lm_heads is None:   # shared LM head: one [depth, h] x [h, Vd] product
            x = torch.stack([self.heads.head_hidden(k, self.h) for k in range(depth)])
            return project(self.linears[0], x)
        return torch.cat([self.head_logits(k, self.h[None]) for k in range(depth)])

    def draft(self, root: int, buf):
        """-> (tree tokens [N] for buffers `buf` (node 0 = root), draft_q(node) -> q [V] of its children or None,
        node_probs [N] with want_probs (greedy and typical drafts) or None)."""
        tokens = torch.empty(buf.num_tokens, dtype=torch.long, device=self.h.device)
        tokens[0] = root
        self._node_probs = torch.ones(buf.num_tokens) if self.want_probs and not self.sampling.samples_drafts else None
        q_of = self.family.draft(self, tokens, buf) if buf.levels else {}            # parent -> q [Vd]
        node_probs, self._node_probs = self._node_probs, None
        return tokens, ((lambda node: self._full_q(q_of[node])) if q_of else None), node_probs
