"""The autoregressive drafters' trees of a batch drafted together: one forward of the draft module a depth for every
sequence's frontier (models/engine/batch.py decodes B sequences; each keeps its own AutoregressiveProposer).

    batch = DraftBatch(proposers)            # after each proposer's begin: its accepted pairs and root's pair run
    rows = batch.scores(frontiers)           # depth >= 1: [R, Vd] per sequence, one forward for all of them

The sequences' draft caches (each [1, kv_heads, len_b, head_dim] a layer: its accepted pairs, then its root's) are
copied once per tree into one right-padded batch cache [B, kv_heads, L, head_dim], L the longest; the drafted rows
of every depth are appended behind it, for all sequences at the same columns, and the whole batch cache is dropped
with the tree (each proposer's own cache never held drafted rows past its root's: its end() crops that). Row b's
queries sit at position accepted_b + depth, as alone, and see its accepted columns, its root's column (the root is
every node's ancestor) and the drafted columns of their ancestors; its padding columns are hidden. So each sequence
attends to exactly what it attends to alone: the same drafts, greedy decoding unchanged (tests/test_batch.py).
"""
from __future__ import annotations

import torch

from models.engine.kv_cache import new_cache


class DraftBatch:
    def __init__(self, proposers: list):
        self.proposers = proposers
        first = proposers[0]
        self.draft, self.logits, self.head_dtype = first.draft, first.logits, first.head_dtype
        self.accepted = [p.accepted for p in proposers]                  # each row's accepted pairs; its root next
        lengths = [a + 1 for a in self.accepted]
        self.width = max(lengths)
        self.cache = new_cache()
        for i in range(len(first.cache.layers)):
            layers = [p.cache.layers[i] for p in proposers]
            keys = torch.zeros(len(proposers), *layers[0].keys.shape[1:2], self.width, layers[0].keys.shape[-1],
                               dtype=layers[0].keys.dtype, device=layers[0].keys.device)
            values = torch.zeros(len(proposers), *layers[0].values.shape[1:2], self.width, layers[0].values.shape[-1],
                                 dtype=layers[0].values.dtype, device=layers[0].values.device)
            for b, (layer, n) in enumerate(zip(layers, lengths)):
                keys[b, :, :n], values[b, :, :n] = layer.keys[0, :, :n], layer.values[0, :, :n]
            self.cache.update(keys, values, i)
        device = keys.device
        self.device = device
        cols = torch.arange(self.width, device=device)
        acc = torch.tensor(self.accepted, device=device)
        self.base_visible = cols[None] < acc[:, None]                      # [B, width]: the accepted columns
        self.root_col = cols[None] == acc[:, None]                         # [B, width]: the root pair's column
        self.run = None                                                    # drafted nodes in column order
        self.pred = torch.stack([p.pred[0] for p in proposers])[:, None]   # [B, N, h]: predicted features by node

    @torch.no_grad()
    def scores(self, frontiers: list) -> list[torch.Tensor]:
        """Depth >= 1 of every sequence's tree: the frontier's nodes (the same nodes in each: one tree) through the
        draft module in one forward -> each sequence's children logits [R, Vd]."""
        f0, B, dtype = frontiers[0], len(frontiers), self.draft.dtype
        nodes, R = f0.nodes, f0.nodes.numel()
        if self.pred.shape[1] < f0.tokens.numel():                         # room for every node of the tree
            grown = self.pred.new_zeros(B, f0.tokens.numel(), self.pred.shape[-1])
            grown[:, :self.pred.shape[1]] = self.pred
            self.pred = grown
        feats = self.pred[:, f0.parents]                                               # [B, R, h]
        tokens = torch.stack([f.tokens[nodes] for f in frontiers]).to(self.device)     # [B, R]
        self.run = nodes if self.run is None else torch.cat([self.run.to(nodes.device), nodes])
        seen_root = f0.ancestors[:, 0].to(self.device)                                 # [R]
        seen = f0.ancestors[:, self.run].to(self.device)                               # [R, C]: drafted columns
        visible = torch.cat([(self.base_visible[:, None] | (self.root_col[:, None] & seen_root[None, :, None])),
                             seen[None].expand(B, -1, -1)], dim=-1)                    # [B, R, width + C]
        mask = torch.zeros(visible.shape, dtype=dtype, device=self.device).masked_fill(~visible,
                                                                                       torch.finfo(dtype).min)
        pos = (torch.tensor(self.accepted, device=self.device) + f0.depth)[:, None].expand(B, R)
        out = self.draft(feats.to(dtype), tokens, pos, cache=self.cache, attention_mask=mask[:, None])   # [B, R, h]
        self.pred[:, nodes] = out
        logits = self.logits(self.draft.readout(out.reshape(B * R, -1)).to(self.head_dtype))           # [B*R, Vd]
        return list(logits.view(B, R, -1))
