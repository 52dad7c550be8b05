"""A method's proposer driven as TreeDrafter drives it, for tests that look at one tree's proposals."""
from __future__ import annotations

import torch

from models.engine.acceptance import SamplingConfig
from models.engine.drafting import DraftContext, draft_tree, proposer_for


def started(heads, hidden: torch.Tensor, sampling: SamplingConfig | None = None, generator=None, input_ids=None):
    """heads' proposer (the factory of the Method the heads carry), started on the prompt's hidden states [T, h]."""
    proposer = proposer_for(heads)
    proposer.start(DraftContext(input_ids, hidden, sampling or SamplingConfig(), generator))
    return proposer


def propose(proposer, root: int, buf, sampling: SamplingConfig | None = None, generator=None, want_probs=False):
    """-> (tokens [N], draft_q, node_probs) of the tree `buf` below root."""
    return draft_tree(proposer, root, buf, sampling or SamplingConfig(), generator, want_probs)
