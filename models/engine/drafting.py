"""Drafting a tree of candidate tokens with draft heads: one batched head call per depth.

    drafter = Drafter(heads, sampling, generator)
    drafter.start(prompt_hidden)                    # [T, h] base hidden states of the prompt
    tokens, draft_q = drafter.draft(root, buffers)  # tokens [N] (node 0 = root), draft_q(node) -> q [V] or None
    drafter.advance(hidden[path], position)         # after acceptance: the accepted nodes' base hidden states

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
from models.heads.families import get_family
from models.heads import DraftHeads
from models.engine.kv_cache import new_cache
from models.engine.projection import project


class Drafter:
    def __init__(self, heads, sampling: SamplingConfig, generator: torch.Generator | None = None):
        self.heads, self.sampling, self.generator = heads, sampling, generator
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
        self.history: list[tuple[int, torch.Tensor]] = []   # (positions seen, h then) of the last advances (rewind)
        self.track_probs = False                        # draft() fills node_probs (greedy and typical drafts)
        self.last_probs = None
        self.node_probs = None                          # [N]: product of the heads' probabilities root -> node
        params = next(iter(heads.parameters()), None) if isinstance(heads, torch.nn.Module) else None
        self.dtype = None if params is None else params.dtype   # the heads' dtype (the base may run in bf16)

    # -- state ---------------------------------------------------------------------------------
    def start(self, hidden: torch.Tensor) -> None:
        """hidden: [T, h] base hidden states of the whole prompt (positions 0..T-1)."""
        self.prefix_cache = new_cache() if self.family.prefix_layer else None
        self.history = []
        self.advance(hidden, 0)

    def advance(self, hidden: torch.Tensor, position: int) -> None:
        """hidden: [m, h] base hidden states of newly accepted positions position..position+m-1."""
        if self.prefix_cache is None:
            h = hidden[-1]
        else:
            pos = torch.arange(position, position + hidden.shape[0], device=hidden.device).unsqueeze(0)
            h = self.heads.prefix_forward(hidden.unsqueeze(0), pos, cache=self.prefix_cache)[0, -1]
        self.h = h if self.dtype is None else h.to(self.dtype)
        self.history = [*self.history[-(self.HISTORY - 1):], (position + hidden.shape[0], self.h)]

    HISTORY = 16

    def rewind(self, position: int) -> None:
        """Back to the state after the first `position` positions: one of the last HISTORY advances' ends."""
        while self.history and self.history[-1][0] > position:
            self.history.pop()
        if not self.history or self.history[-1][0] != position:
            raise ValueError(f"the drafter can rewind to the end of one of its last {self.HISTORY} advances, "
                             f"not to position {position}")
        self.h = self.history[-1][1]
        if self.prefix_cache is not None:
            self.prefix_cache.crop(position - self.prefix_cache.get_seq_length())

    # -- proposals -----------------------------------------------------------------------------
    def pick(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [R, Vd] -> (proposed token ids [R, k], warped q [R, Vd] when proposals are sampled, else None).
        With track_probs, self.last_probs = the heads' softmax probability of each proposal [R, k]."""
        if k > logits.shape[-1]:
            raise ValueError(f"the tree asks for {k} ranks per node but the heads score only {logits.shape[-1]} "
                             "tokens (draft_vocab_size): use a tree with fewer ranks or a larger draft vocabulary")
        if not self.sampling.samples_drafts:
            top = torch.topk(logits, k, dim=-1)
            picks, q = top.indices, None
            if self.track_probs:                    # softmax at the top-k: exp(l - logsumexp(l))
                self.last_probs = (top.values - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
        else:
            q = warp_probs(logits, self.sampling)
            race = torch.empty_like(q).exponential_(generator=self.generator)
            picks = torch.topk(q / race, k, dim=-1).indices                    # = k draws from q without replacement
        return (picks if self.draft_ids is None else self.draft_ids[picks]), q

    def _full_q(self, q: torch.Tensor) -> torch.Tensor:
        """q [Vd] over the draft vocabulary -> [V] over the full vocabulary, zero outside the draft vocabulary."""
        if self.draft_ids is None:
            return q
        return q.new_zeros(self.heads.config.vocab_size).index_copy_(0, self.draft_ids, q)

    def head_logits(self, k: int, hidden: torch.Tensor, path: torch.Tensor | None = None) -> torch.Tensor:
        """Head k's logits over the draft vocabulary: hidden [R, h], path [R, k+1] -> [R, Vd], with the fast projection."""
        if self.linears is None:
            return self.heads.head_logits(k, hidden, path)
        return project(self.linears[k], self.heads.head_hidden(k, hidden, path))

    def note_probs(self, level, probs: torch.Tensor) -> None:
        """After pick for one depth: probs [P, R] of its proposals -> node_probs of the level's nodes."""
        if self.node_probs is not None and probs is not None:
            parent_p = self.node_probs[level.parents[level.parent_slot]]
            self.node_probs[level.nodes] = parent_p * probs[level.parent_slot, level.ranks].float().cpu()

    def all_heads_logits(self, depth: int) -> torch.Tensor:
        """Heads 0..depth-1 on h_t alone (no path: Medusa) -> [depth, Vd]."""
        if self.linears is not None and self.heads.lm_heads is None:   # shared LM head: one [depth, h] x [h, Vd] product
            x = torch.stack([self.heads.head_hidden(k, self.h) for k in range(depth)])
            return project(self.linears[0], x)
        return torch.cat([self.head_logits(k, self.h[None]) for k in range(depth)])

    def draft(self, root: int, buf):
        """Tree tokens [N] for buffers `buf` (node 0 = root) and draft_q(node) -> q [V] of its children (or None)."""
        tokens = torch.empty(buf.num_tokens, dtype=torch.long, device=self.h.device)
        tokens[0] = root
        self.node_probs = torch.ones(buf.num_tokens) if self.track_probs else None
        if not buf.levels:
            return tokens, None
        q_of = self.family.draft(self, tokens, buf)                                  # parent -> q [Vd]
        return tokens, ((lambda node: self._full_q(q_of[node])) if q_of else None)
