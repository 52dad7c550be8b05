"""Verify and greedy acceptance of a tree that never left the device (a DeviceTree: drafters/graphed_growth.py).

    hidden = verify_device_tree(decoder, tree, cache, past, dtype)       # [K, h], the cache grown by K rows
    path, drafts, bonus = accept_on_device(tree, base_logits(hidden))   # one read of the device, nothing before

The host-side rule (acceptance.accept_greedy) walks the tree's buffers, which a grown tree at fixed shapes never
builds. Here the same rule is a few tensor operations over all K nodes: a node is accepted when its token is the
base's argmax at its parent and all its ancestors are accepted; the deepest accepted node ends the path (siblings
hold distinct tokens, so at most one node of a depth is accepted: the path is the host rule's), and its argmax is
the bonus. The path's node indices, its tokens and the bonus are gathered on the device and read in one transfer,
the step's only wait for the device. Commit is the engine's (kv_cache.keep_accepted), by those indices.
"""
from __future__ import annotations

import torch

from models.engine.drafters.base import DeviceTree


def verify_device_tree(decoder, tree: DeviceTree, cache, past: int, dtype: torch.dtype, masks) -> torch.Tensor:
    """One base forward over the tree's K tokens after `past` cached positions -> hidden [K, h]. masks(tree_part,
    depth, past, dtype, device): the decoder's 4-D mask from the tree's additive part (decoding.tree_masks)."""
    device = tree.tokens.device
    part = torch.zeros(tree.ancestors.shape, dtype=dtype, device=device)
    part.masked_fill_(~tree.ancestors, torch.finfo(dtype).min)
    mask = masks(part[None, None], tree.depth, past, dtype, device)
    out = decoder(input_ids=tree.tokens[None], attention_mask=mask, position_ids=(tree.depth + past)[None],
                  past_key_values=cache, use_cache=True)
    return out.last_hidden_state[0]


def accept_on_device(tree: DeviceTree, logits: torch.Tensor) -> tuple[list[int], list[int], int]:
    """Greedy acceptance over the K nodes' base logits [K, V] (module docstring) -> (the accepted path's node
    indices, root first and rising; its drafted tokens; the bonus token)."""
    K = tree.tokens.numel()
    pred = logits.argmax(-1)                                                       # [K] the base's next token
    ok = tree.tokens == pred[tree.parent]
    ok[0] = True
    accepted = (ok[None, :] | ~tree.ancestors).all(1)                             # every ancestor and itself ok
    best = torch.where(accepted, tree.depth, -1).argmax()                          # the deepest (first on ties)
    index = torch.arange(K, device=tree.tokens.device)
    path = torch.sort(torch.where(tree.ancestors[best], index, K)).values          # its nodes first, rising
    m = tree.depth[best] + 1
    read = torch.cat([m[None], path, tree.tokens[path.clamp(max=K - 1)], pred[best][None]]).tolist()
    count = read[0]
    return read[1:1 + count], read[2 + K:1 + K + count], read[-1]
