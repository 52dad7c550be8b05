"""The autoregressive drafters' proposer (EAGLE-1, EAGLE-3, a draft model): the draft module (models/methods/eagle/
eagle.py, eagle3.py, models/methods/draft_model/draft_model.py) run over its own predicted features, one batched
forward per depth of the frontier (each method's Method names it as its proposer; the protocol:
models/engine/drafters/proposer.py):

    drafter = make_drafter({"kind": "heads", "tree": spec}, heads=eagle_heads)   # a DraftHeads of family eagle:
                                                                                 # its LM head, draft vocabulary
    drafter = EagleDrafter(eagle, spec)       # a bare EagleModule: full vocabulary (models/methods/eagle/drafter.py)
    res = generate(model, tok, ids, drafter=drafter)

The features are the base's final hidden states, or for EAGLE-3 the taps its module names (its `taps`): the
decode step hands the drafter those in place of the final states (DraftContext.hidden, advance's hidden), and the
first depth's fc fuses them; deeper depths read the layer's own outputs, the LM head its readout (final norm).

State after start/advance, with P positions accepted (the base cache holds 0..P-1, the root x_P is next): the
draft cache holds the pairs (f_t, x_{t+1}) of t = 0..P-2, i.e. P-1 rows, all of them accepted, and `feature`
is f_{P-1}, the base's hidden state of the last accepted position. advance() appends the pairs the accepted
path completes: (f_{P-1}, x_P), (f_P, x_{P+1}), ..., so the draft cache never holds a rejected position.
Those pairs are written by the next draft's first forward, together with the root's pair (as the authors'
topK_genrate does): one forward a step where two ran, the same rows and the same causal view. Reading `cache`
writes them first, so that from outside the cache is always as described.

A tree is drafted between begin() and end(), one scores(frontier) a depth. Frontier node i at depth d is the pair
(its parent's predicted feature, token i) at position P-1+d; the root's pair is (f_{P-1}, root). The frontier's
nodes run in one forward whose rows are appended to the draft cache behind the accepted ones, with a 4-D
additive mask (every accepted row visible; of the drafted rows, the node's ancestors and itself: the tree mask,
as the base's verify step). The node's predicted feature through the LM head gives its children's logits
(select_children picks them). end() crops the drafted rows off, so the cache again holds the accepted pairs
only. The draft layer attends to the whole context (a sliding window is not applied to it).

With DraftContext.static (a fixed tree's drafts replayed as a CUDA graph: models/engine/drafters/graphed.py) the
draft cache is a StaticDraftCache instead (models/shared/autoregressive/static_cache.py): fixed capacity, the accepted rows'
count read from a device tensor that prepare_static fills before each draft, f_{P-1} overwritten in place, and
end() drops nothing (the next rows overwrite the drafted ones, and the masks hide them until then).
"""
from __future__ import annotations

import torch

from models.engine.drafters.base import AdvanceHistory, DraftContext
from models.engine.drafters.proposer import Frontier
from models.engine.kv_cache import new_cache
from models.engine.projection import BaseLogits, logit_transform, project
from models.shared.autoregressive.static_cache import StaticDraftCache

__all__ = ["AutoregressiveProposer"]


class AutoregressiveProposer:
    """The draft layer's state and proposals. heads: an AutoregressiveHeads (its draft_module, its LM head over the
    draft vocabulary) or None with `module`, a bare draft module (EagleModule: models/methods/eagle/drafter.py) scored
    by the base LM head over the full vocabulary with the model's logit transform."""

    capturable = True      # with a static draft cache (DraftContext.static): the draft's shapes are fixed
    fold_root = True       # the root's pair run in the forward that writes the accepted pairs (False: its own)

    def __init__(self, heads=None, module=None):
        if (heads is None) == (module is None):
            raise ValueError("an autoregressive proposer takes autoregressive heads (heads=...) or a bare draft module "
                             "(module=...), one of the two")
        self.draft = heads.draft_module if heads is not None else module    # any AutoregressiveDraft
        self.max_depth = None                  # the layer runs over its own outputs: as deep as a tree asks
        self.taps = self.draft.taps            # EAGLE-3: the decode step hands it these base states, not the final
        if heads is not None:
            linear, self.to_ids = heads.output_layer(0), heads.to_token_ids                      # [R, h] -> [R, Vd]
            self.logits = lambda x: project(linear, x)
            self.head_dtype = linear.weight.dtype
            self.draft_ids, self.vocab_size = heads.draft_ids, heads.config.vocab_size
        else:
            self.logits = BaseLogits(self.draft.lm_head, logit_transform(self.draft.base_config))   # [R, h] -> [R, V]
            self.to_ids, self.head_dtype = (lambda index: index), self.draft.lm_head.weight.dtype
            self.draft_ids, self.vocab_size = None, self.draft.base_config.vocab_size
        self._cache = new_cache()                      # the draft layer's KV rows: accepted pairs only
        self.pending: list[tuple[torch.Tensor, ...]] = []   # accepted pairs (feats, tokens, positions) not yet run
        self.feature = None                            # [h] f_{P-1}, the last accepted position's base feature
        self.history = AdvanceHistory()                # (P, f_{P-1}) after each of the last advances
        self.accepted, self.pred, self.run = 0, None, None   # while drafting: cache rows kept, [N, h], nodes run
        self.root_logits = None                        # the root pair's children, run with the pending pairs
        self.static: StaticDraftCache | None = None    # the draft cache at fixed shapes, when asked for

    @property
    def device(self) -> torch.device:
        return self.feature.device

    @property
    def cache(self):
        """The draft cache with every accepted pair in it (the pending ones written first)."""
        self.flush()
        return self._cache

    # -- state ---------------------------------------------------------------------------------
    def start(self, ctx: DraftContext) -> None:
        """The prompt's pairs (f_t, x_{t+1}), t = 0..T-2, into a fresh draft cache; f_{T-1} kept. ctx.hidden [T, h],
        ctx.input_ids [T]."""
        hidden, input_ids = ctx.hidden, ctx.input_ids
        if input_ids is None:
            raise ValueError("the autoregressive drafter needs the prompt's token ids (DraftContext.input_ids)")
        self.history.clear()
        T = hidden.shape[0]
        if ctx.static:
            self.static = StaticDraftCache.for_prompt(self.static, len(self.draft.layers), T, hidden.device,
                                                      self.draft.dtype)
            self._cache = self.static.cache
        else:
            self.static, self._cache = None, new_cache()
        self.pending = []
        if T > 1:
            pos = torch.arange(T - 1, device=hidden.device)[None]                  # [1, T-1]
            self.write(hidden[None, :-1], input_ids[None, 1:].to(hidden.device), pos)
        self.keep(T, hidden[-1])

    def write(self, feats: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor) -> None:
        """Accepted pairs [1, m, h], [1, m] at positions [1, m] into the draft cache (causal over what it holds):
        at once with a static cache (a captured draft reads fixed rows), else with the next draft's first forward."""
        if self.static is None:
            self.pending.append((feats, tokens, pos))
            return
        m = tokens.shape[1]
        self.static = self.static.with_room(m)
        self._cache = self.static.cache
        self.draft(feats, tokens, pos, cache=self._cache, attention_mask=self.static.rows(m))
        self.static.commit(m)

    def held(self) -> int:
        """Accepted pairs written or pending."""
        return self._cache.get_seq_length() + sum(r[1].shape[1] for r in self.pending)

    @torch.no_grad()
    def flush(self, root: int | None = None) -> torch.Tensor | None:
        """The pending pairs, and the root's pair (f_{P-1}, root) at position P-1 when given, in one causal forward
        -> the root pair's output [h] (None without a root)."""
        rows = list(self.pending)
        if root is not None:
            P = self.held() + 1
            device = self.feature.device
            rows.append((self.feature[None, None], torch.tensor([[int(root)]], device=device),
                         torch.tensor([[P - 1]], device=device)))
        self.pending = []
        if not rows:
            return None
        feats, tokens, pos = (torch.cat([r[i] for r in rows], dim=1) for i in range(3))
        out = self.draft(feats.to(self.draft.dtype), tokens, pos, cache=self._cache)
        return out[0, -1] if root is not None else None

    def advance(self, hidden: torch.Tensor, tokens: list[int], position: int) -> None:
        """hidden [m, h], tokens [m] (root first): the accepted positions position..position+m-1. Appends the
        pairs (f_{position-1}, x_position), (f_position, x_{position+1}), ... at positions position-1 ..."""
        if self.held() != position - 1:
            raise ValueError(f"the autoregressive drafter holds {self.held() + 1} positions, cannot advance from position "
                             f"{position}")
        m = hidden.shape[0]
        feats = torch.cat([self.feature[None], hidden[:-1].to(self.feature.dtype)])      # [m, h]
        toks = torch.as_tensor(tokens, dtype=torch.long, device=hidden.device)           # [m]
        pos = torch.arange(position - 1, position - 1 + m, device=hidden.device)         # [m]
        self.write(feats[None], toks[None], pos[None])
        self.keep(position + m, hidden[-1])

    def keep(self, positions: int, feature: torch.Tensor) -> None:
        feature = feature.to(self.draft.dtype)
        self.history.push(positions, feature)
        self.set_feature(feature)

    def set_feature(self, feature: torch.Tensor) -> None:
        """f_{P-1} into self.feature: in the same storage as before where it fits (a captured draft reads that)."""
        f = self.feature
        same = f is not None and (f.shape, f.dtype, f.device) == (feature.shape, feature.dtype, feature.device)
        if same and (torch.is_inference_mode_enabled() or not torch.is_inference(f)):
            f.copy_(feature)
        else:
            self.feature = feature.clone()

    def rewind(self, position: int) -> None:
        """Back to the state after the first `position` positions: one of the last advances' ends."""
        self.set_feature(self.history.back_to(position, "the autoregressive drafter"))
        if self.static is not None:
            self.static.crop(position - 1)
        else:
            self.flush()
            self._cache.crop(position - 1 - self._cache.get_seq_length())

    def static_inputs(self) -> tuple[torch.Tensor, ...]:
        """What a draft reads that changes between steps (a captured draft checks their storage is unmoved)."""
        if self.static is None:
            raise ValueError("the autoregressive drafter's drafts have fixed shapes only with a static draft cache "
                             "(DraftContext.static)")
        return (self.feature, *self.static.tensors())

    def prepare_static(self, num_nodes: int) -> None:
        """Before a draft of num_nodes tree rows, outside a captured graph: room for them, and the accepted rows'
        count where the draft reads it."""
        self.static = self.static.with_room(num_nodes)
        self._cache = self.static.cache
        self.static.set_base()

    # -- proposals -----------------------------------------------------------------------------
    def begin(self, root: int, depth: int) -> None:
        self.pred, self.run, self.root_logits = None, None, None
        if self.static is not None or depth == 0 or not self.fold_root:
            self.accepted = self.cache.get_seq_length()              # the pending pairs written
            return
        out = self.flush(root)                                      # the accepted pairs and the root's, one forward
        self.accepted = self._cache.get_seq_length() - 1
        self.run, self.pred = torch.zeros(1, dtype=torch.long), out[None]
        self.root_logits = self.logits(self.draft.readout(out[None]).to(self.head_dtype))        # [1, Vd]

    @torch.no_grad()
    def scores(self, frontier: Frontier) -> torch.Tensor:
        """The frontier's nodes through the draft layer in one forward (their rows appended to the draft cache,
        tree-masked) -> the logits of their children [R, Vd]; their predicted features kept for the next depth."""
        if frontier.depth == 0 and self.root_logits is not None:                               # run by begin
            return self.root_logits
        device, dtype, nodes = self.feature.device, self.draft.dtype, frontier.nodes
        feats = self.feature[None] if frontier.depth == 0 else self.pred[frontier.parents]       # [R, h]
        offset = 0 if self.run is None else self.run.numel()
        self.run = nodes if self.run is None else torch.cat([self.run.to(nodes.device), nodes])   # [C] in cache order
        seen = frontier.ancestors[:, self.run].to(device)                                        # [R, C]
        if self.static is not None:                # graph-safe: slots and positions from the device's base
            mask = self.static.tree_rows(offset, seen)
            pos = (self.static.base + frontier.depth).expand(1, nodes.numel())
        else:
            mask = torch.zeros(1, 1, nodes.numel(), self.accepted + self.run.numel(), dtype=dtype, device=device)
            mask[..., self.accepted:].masked_fill_(~seen, torch.finfo(dtype).min)
            pos = torch.full((1, nodes.numel()), self.accepted + frontier.depth, dtype=torch.long, device=device)
        out = self.draft(feats[None], frontier.tokens[nodes][None], pos, cache=self._cache, attention_mask=mask)[0]
        n = frontier.tokens.numel()
        if self.pred is None or self.pred.shape[0] < n:
            grown = out.new_empty(n, out.shape[-1])
            if self.pred is not None:
                grown[:self.pred.shape[0]] = self.pred
            self.pred = grown
        self.pred[nodes] = out                                                                   # [R, h]
        return self.logits(self.draft.readout(out).to(self.head_dtype))

    def end(self) -> None:
        if self.static is None:
            self._cache.crop(self.accepted - self._cache.get_seq_length())                      # drafted rows off
        self.pred, self.run, self.root_logits, self.together = None, None, None, None

    # -- a batch's trees, drafted together (models/engine/drafters/proposer.py draft_trees) ------------------------
    together = None                    # the DraftBatch this proposer drafts in, between begin_many and end

    @staticmethod
    def begin_many(proposers: list, roots: list[int], depth: int) -> None:
        """Each proposer's begin (its pending pairs and its root's, one forward each), then, where every one of them
        folded its root, one DraftBatch for the depths below (models/shared/autoregressive/batch.py)."""
        from models.shared.autoregressive.batch import DraftBatch

        for p, root in zip(proposers, roots):
            p.begin(root, depth)
        if depth > 1 and all(p.root_logits is not None for p in proposers):
            batch = DraftBatch(proposers)
            for p in proposers:
                p.together = batch

    @staticmethod
    def scores_many(proposers: list, frontiers: list) -> list[torch.Tensor]:
        batch = proposers[0].together
        if frontiers[0].depth == 0 or batch is None:
            return [p.scores(f) for p, f in zip(proposers, frontiers)]
        return batch.scores(frontiers)
