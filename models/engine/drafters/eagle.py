"""EAGLE-1's proposals on a tree: the draft layer (models/heads/eagle.py) run autoregressively over its own
predicted features, one batched forward per depth. TreeDrafter (tree.py) drives it like the heads' drafter:

    drafter = make_drafter({"kind": "heads", "tree": spec}, heads=eagle_heads)   # a DraftHeads of family eagle:
                                                                                 # its LM head, draft vocabulary
    drafter = make_drafter({"kind": "eagle", "tree": spec}, eagle=eagle)         # a bare EagleModule: full vocabulary
    res = generate(model, tok, ids, drafter=drafter)

The features are the base's final hidden states, or for EAGLE-3 the taps its module names (eagle.taps): the
decode step hands the drafter those in place of the final states (DraftContext.hidden, advance's hidden), and the
first depth's fc fuses them; deeper depths read the layer's own outputs, the LM head its readout (final norm).

State after start/advance, with P positions accepted (the base cache holds 0..P-1, the root x_P is next): the
draft cache holds the pairs (f_t, x_{t+1}) of t = 0..P-2, i.e. P-1 rows, all of them accepted, and `feature`
is f_{P-1}, the base's hidden state of the last accepted position. advance() appends the pairs the accepted
path completes: (f_{P-1}, x_P), (f_P, x_{P+1}), ..., so the draft cache never holds a rejected position.

draft(root, buf) drafts the tree below the root depth by depth. Node i at depth d is the pair (its parent's
predicted feature, token i) at position P-1+d; the root's pair is (f_{P-1}, root). Only the nodes with children
are run: those of one depth in one forward whose rows are appended to the draft cache behind the accepted ones,
with a 4-D additive mask (every accepted row visible; of the drafted rows, the node's ancestors and itself:
the tree mask, as the base's verify step). The node's predicted feature through the LM head gives its
children: the top-k ranks the tree asks for, or (lossless sampling with draft="sample") as many draws without
replacement from q = the node's warped draft distribution (warp_probs with the base's temperature, top-k and
top-p), handed to the acceptance rule as draft_q(node) over the full vocabulary (zero outside a draft
vocabulary). The drafted rows are cropped off at the end of draft(), so the cache again holds the accepted pairs
only. The draft layer attends to the whole context (a sliding window is not applied to it).
"""
from __future__ import annotations

import torch

from models.engine.acceptance import SamplingConfig
from models.engine.drafters.base import AdvanceHistory
from models.engine.drafters.heads import draw_without_replacement, full_vocabulary_q
from models.engine.kv_cache import new_cache
from models.engine.projection import BaseLogits, logit_transform, project
from models.engine.trees import TreeBuffers

__all__ = ["EagleProposer"]


class EagleProposer:
    """The draft layer's state and proposals. heads: a DraftHeads of the eagle family (its layer, its LM head
    over the draft vocabulary) or None with `eagle`, a bare EagleModule scored by the base LM head over the full
    vocabulary with the model's logit transform. want_probs: draft() also returns node_probs, the product of the
    draft's softmax probabilities root -> node (top-k drafts)."""

    def __init__(self, heads=None, eagle=None, want_probs: bool = False):
        if (heads is None) == (eagle is None):
            raise ValueError("an eagle proposer takes eagle heads (heads=...) or a bare EagleModule (eagle=...)")
        self.eagle = heads.family.draft_module(heads) if heads is not None else eagle    # any AutoregressiveDraft
        self.taps = self.eagle.taps            # EAGLE-3: the decode step hands it these base states, not the final
        self.want_probs = want_probs
        if heads is not None:
            linear, self.to_ids = heads.output_layer(0), heads.to_token_ids                      # [R, h] -> [R, Vd]
            self.logits = lambda x: project(linear, x)
            self.head_dtype = linear.weight.dtype
            self.draft_ids, self.vocab_size = heads.draft_ids, heads.config.vocab_size
        else:
            self.logits = BaseLogits(self.eagle.lm_head, logit_transform(self.eagle.base_config))   # [R, h] -> [R, V]
            self.to_ids, self.head_dtype = (lambda index: index), self.eagle.lm_head.weight.dtype
            self.draft_ids, self.vocab_size = None, self.eagle.base_config.vocab_size
        self.sampling, self.generator = SamplingConfig(), None    # how children are proposed (start)
        self.cache = new_cache()                       # the draft layer's KV rows: accepted pairs only
        self.feature = None                            # [h] f_{P-1}, the last accepted position's base feature
        self.history = AdvanceHistory()                # (P, f_{P-1}) after each of the last advances

    # -- state ---------------------------------------------------------------------------------
    def start(self, hidden: torch.Tensor, sampling, generator=None, input_ids: torch.Tensor | None = None) -> None:
        """The prompt's pairs (f_t, x_{t+1}), t = 0..T-2, into a fresh draft cache; f_{T-1} kept. hidden [T, h],
        input_ids [T]; sampling: top-k ranks, or draws from `generator` when sampling.samples_drafts."""
        if input_ids is None:
            raise ValueError("the eagle drafter needs the prompt's token ids (DraftContext.input_ids)")
        self.sampling, self.generator = sampling, generator
        self.cache = new_cache()
        self.history.clear()
        T = hidden.shape[0]
        if T > 1:
            pos = torch.arange(T - 1, device=hidden.device)[None]                  # [1, T-1]
            self.eagle(hidden[None, :-1], input_ids[None, 1:].to(hidden.device), pos, cache=self.cache)
        self.keep(T, hidden[-1])

    def advance(self, hidden: torch.Tensor, position: int, tokens: list[int] | None = None) -> None:
        """hidden [m, h], tokens [m] (root first): the accepted positions position..position+m-1. Appends the
        pairs (f_{position-1}, x_position), (f_position, x_{position+1}), ... at positions position-1 ..."""
        if self.cache.get_seq_length() != position - 1:
            raise ValueError(f"the eagle drafter holds {self.cache.get_seq_length() + 1} positions, "
                             f"cannot advance from position {position}")
        m = hidden.shape[0]
        feats = torch.cat([self.feature[None], hidden[:-1].to(self.feature.dtype)])      # [m, h]
        toks = torch.as_tensor(tokens, dtype=torch.long, device=hidden.device)           # [m]
        pos = torch.arange(position - 1, position - 1 + m, device=hidden.device)         # [m]
        self.eagle(feats[None], toks[None], pos[None], cache=self.cache)
        self.keep(position + m, hidden[-1])

    def keep(self, positions: int, feature: torch.Tensor) -> None:
        self.feature = feature.to(self.eagle.dtype)
        self.history.push(positions, self.feature)

    def rewind(self, position: int) -> None:
        """Back to the state after the first `position` positions: one of the last advances' ends."""
        self.feature = self.history.back_to(position, "the eagle drafter")
        self.cache.crop(position - 1 - self.cache.get_seq_length())

    # -- proposals -----------------------------------------------------------------------------
    @torch.no_grad()
    def draft(self, root: int, buf: TreeBuffers):
        """-> (tree tokens [N] for buffers `buf` (node 0 = root), draft_q(node) -> q [V] of its children when they
        are sampled, else None, node_probs [N] with want_probs (top-k drafts) or None)."""
        device = self.feature.device
        tokens = torch.empty(buf.num_tokens, dtype=torch.long, device=device)            # [N]
        tokens[0] = root
        sampled = self.sampling.samples_drafts
        probs = torch.ones(buf.num_tokens) if self.want_probs and not sampled else None  # [N]
        q_of = {} if sampled else None                                                   # parent -> q [Vd]
        accepted = self.cache.get_seq_length()                                           # P-1 rows
        try:
            self.draft_levels(buf, tokens, probs, accepted, q_of)
        finally:
            self.cache.crop(accepted - self.cache.get_seq_length())                     # drafted rows off
        if not q_of:
            return tokens, None, probs
        return tokens, (lambda node: full_vocabulary_q(q_of[node], self.draft_ids, self.vocab_size)), probs

    def draft_levels(self, buf: TreeBuffers, tokens: torch.Tensor, probs: torch.Tensor | None, accepted: int,
                     q_of: dict | None = None) -> None:
        """Fill tokens (and probs, or q_of: parent -> q [Vd] of sampled children) of every depth of `buf` in place;
        the draft cache grows by the rows run."""
        device, dtype = tokens.device, self.eagle.dtype
        tree_mask = buf.tree_mask[0, 0]                                                  # [N, N] ancestors + self
        pred = None                                                                      # [N, h] predicted features
        run = torch.empty(0, dtype=torch.long)                                           # nodes in the cache, in order
        for d, level in enumerate(buf.levels):                                           # level: nodes at depth d+1
            nodes = level.parents                                                        # [R] depth d, run now
            feats = self.feature[None] if d == 0 else pred[buf.parent[nodes]]            # [R, h]
            run = torch.cat([run, nodes])                                                # [C]
            mask = torch.zeros(1, 1, nodes.numel(), accepted + run.numel(), dtype=dtype, device=device)
            mask[..., accepted:].masked_fill_(~tree_mask[nodes][:, run].to(device), torch.finfo(dtype).min)
            pos = torch.full((1, nodes.numel()), accepted + d, dtype=torch.long, device=device)   # P-1+d
            out = self.eagle(feats[None], tokens[nodes][None], pos, cache=self.cache, attention_mask=mask)[0]
            if pred is None:
                pred = out.new_empty(buf.num_tokens, out.shape[-1])
            pred[nodes] = out                                                            # [R, h]
            self.propose(self.logits(self.eagle.readout(out).to(self.head_dtype)), level, buf, tokens, probs, q_of)

    def propose(self, logits: torch.Tensor, level, buf: TreeBuffers, tokens: torch.Tensor,
                probs: torch.Tensor | None, q_of: dict | None) -> None:
        """The children of one level's parents from their draft logits [R, Vd] (row s: level.parents[s]): the
        top-k ranks (and their softmax probabilities into probs), or with q_of draws from q without replacement
        (each parent's q into q_of)."""
        if level.num_ranks > logits.shape[-1]:
            raise ValueError(f"the tree asks for {level.num_ranks} ranks per node but the draft scores "
                             f"{logits.shape[-1]} tokens")
        if q_of is not None:
            picks, q = draw_without_replacement(logits, level.num_ranks, self.sampling, self.generator)   # [R, k]
            q_of.update({int(p): q[s] for s, p in enumerate(level.parents)})
        else:
            top = torch.topk(logits, level.num_ranks, dim=-1)                            # [R, k]
            picks = top.indices
        tokens[level.nodes] = self.to_ids(picks[level.parent_slot, level.ranks])
        if probs is not None:                                                            # softmax at the top-k
            p = (top.values - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()       # [R, k]
            probs[level.nodes] = probs[buf.parent[level.nodes]] * p[level.parent_slot, level.ranks].float().cpu()
