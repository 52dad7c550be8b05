"""The base model's KV cache during decoding: a transformers DynamicCache, pruned to the accepted path.

    cache = new_cache()
    keep_accepted(cache, past, path, num_tree_tokens)   # after a verify step of num_tree_tokens tokens

After verifying a tree, the cache holds past + N entries: the committed prefix and every tree
node. Only the accepted nodes (root first, ancestors before descendants, so their indices rise)
may stay; their rows are moved down to past..past+m-1 and the rest is cut off. Every layer is a
plain DynamicLayer (keys/values [B, kv_heads, T, head_dim]) that concatenates on update.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache() -> DynamicCache:
    # No config: every layer is a full-attention DynamicLayer. (Sliding-window layers would keep
    # their own truncated view and could not be pruned row by row.)
    return DynamicCache()


def keep_accepted(cache: DynamicCache, past: int, path: list[int], num_tree_tokens: int) -> None:
    """Keep rows past + path (node indices, rising) of the last verify step; drop the other tree rows."""
    m = len(path)
    if path == list(range(m)):                            # a prefix of the tree: cropping is enough
        if m < num_tree_tokens:
            cache.crop(m - num_tree_tokens)
        return
    src = torch.tensor(path, device=cache.layers[0].keys.device) + past
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name)                      # [B, kv_heads, past + N, head_dim]
            t[:, :, past:past + m] = t[:, :, src]         # the gather copies first, so overlap is safe
            setattr(layer, name, t[:, :, :past + m])
