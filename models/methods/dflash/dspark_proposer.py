"""DSpark's proposer: DFlash's block forward (models/methods/dflash/proposer.py), then each tree node's children
scored with the Markov bias of the node's own token, so that position d + 1 sees the token drafted at d. A chain
(top-1 per depth) is the greedy chain the paper drafts; a tree gives each node's top-k under its own bias. The rnn
head runs its state along each node's path of block slots, from slot 0 (the root's). Without sample_from_anchor slot 0
drafts nothing and its bias is the root's own (the library's convention); with it slot 0 drafts depth 1 from the
root, so slot k's Markov input is the token at depth k, as training's.

The confidence head's cut: a drafter cut per step by cost (TreeDrafter's step_cost, tree=cut) multiplies along
each path the probability that a node's top child is accepted, and this proposer gives it from its confidence head
(child_accept) rather than from its logits; cut_by_cost then keeps the nodes whose acceptance pays for their verify
cost on this machine's latency profile, so the chain ends where its survival product falls below what the next
token costs here (models/engine/drafters/cut.py).
"""
from __future__ import annotations

import torch

from models.engine.drafters.proposer import Frontier
from models.methods.dflash.proposer import DFlashProposer


class DSparkProposer(DFlashProposer):
    def scores(self, frontier: Frontier) -> torch.Tensor:
        d, R, f = frontier.depth, frontier.nodes.numel(), self.module.first_slot
        markov = self.heads.markov
        outs = self.outs[:d + 1 + f]                              # slots 0 to the one drafting depth d + 1
        paths = frontier.paths.to(self.device)                                              # [R, d + 1]: root..node
        prev = torch.cat([paths[:, :1]] * f + [paths], 1)         # the token before each slot's (slot 0's: the root)
        bias = markov.last(prev, outs[None].expand(R, -1, -1))                             # [R, Vd]
        return self.rows[d:d + 1] + bias.to(self.rows.dtype)

    def child_accept(self, frontier: Frontier) -> torch.Tensor:
        """The confidence head's probability [R] that each node's top child (block position depth + 1, after the
        node's own token) is accepted: what a per-step cut multiplies along a path (TreeDrafter's step_cost)."""
        d, R, f = frontier.depth, frontier.nodes.numel(), self.module.first_slot
        out = self.outs[d + f:d + f + 1][None].expand(R, -1, -1)                            # [R, 1, h]
        prev = frontier.paths[:, -1:].to(self.device)                                        # [R, 1]
        return torch.sigmoid(self.heads.accept_logits(out, prev))[:, 0]
