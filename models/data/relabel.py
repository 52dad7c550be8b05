"""Relabelling: the assistant labels of existing conversations become the base model's own next-token argmax.

    new_labels, stats = relabel_conversations(model, [input_ids, ...], [labels, ...], batch_tokens=8192, workers=2)

Teacher forcing, no generation: the conversation's own tokens go through the model, and every
position t whose label is not -100 gets label argmax(logits at t-1), the token the model would
have written there after that very text; every other position (and t = 0) stays -100. input_ids
are not changed. Conversations are sorted by length and cut into batches of at most batch_tokens
padded tokens, right-padded (causal attention: a real token never sees the padding after it, so
the forward needs no mask), a conversation is forwarded only up to its last assistant token, and
the LM head runs only on the positions before an assistant token, head_rows rows at a time (argmax
over the vocabulary without holding [B, T, V] logits).
"""
from __future__ import annotations

from typing import Callable

import torch

from models.data.distill_gen import map_batches

IGNORE_INDEX = -100


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices sorted by length, cut into batches whose rows x longest row stay within batch_tokens."""
    batches, current = [], []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if current and (len(current) + 1) * lengths[i] > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    return batches + [current] if current else batches


def forward_length(labels: list[int]) -> int:
    """Tokens a conversation needs forwarded: those before its last labelled position (0: none labelled)."""
    return max((t for t, l in enumerate(labels) if l != IGNORE_INDEX), default=0)


@torch.no_grad()
def relabel_batch(model, input_ids: list[list[int]], labels: list[list[int]], head_rows: int = 512
                  ) -> list[list[int]]:
    """New labels of one batch: argmax of the logits at t-1 wherever labels[t] != -100."""
    device = next(model.parameters()).device
    need = [forward_length(y) for y in labels]
    B, T = len(input_ids), max(need)
    if T == 0:
        return [[IGNORE_INDEX] * len(x) for x in input_ids]
    ids = torch.zeros((B, T), dtype=torch.long)                    # right-padded; padding is never read
    old = torch.full((B, T + 1), IGNORE_INDEX, dtype=torch.long)
    for row, (x, y, n) in enumerate(zip(input_ids, labels, need)):
        ids[row, :n] = torch.as_tensor(x[:n])
        old[row, :n + 1] = torch.as_tensor(y[:n + 1])
    hidden = model.get_decoder()(input_ids=ids.to(device)).last_hidden_state   # [B, T, h]
    targets = old[:, 1:] != IGNORE_INDEX                              # [B, T]: position t-1 predicts label t
    rows = hidden[targets.to(device)]                                 # [P, h]
    lm_head = model.get_output_embeddings()
    preds = torch.cat([lm_head(rows[i:i + head_rows]).argmax(-1) for i in range(0, rows.shape[0], head_rows)])  # [P]
    new = torch.full((B, T + 1), IGNORE_INDEX, dtype=torch.long)
    new[:, 1:][targets] = preds.cpu()
    return [new[row, :len(x)].tolist() + [IGNORE_INDEX] * (len(x) - T - 1) for row, x in enumerate(input_ids)]


def relabel_conversations(model, input_ids: list[list[int]], labels: list[list[int]], batch_tokens: int,
                          head_rows: int = 512, workers: int = 1, on_batch: Callable[[int], None] | None = None
                          ) -> tuple[list[list[int]], dict]:
    """New labels for every conversation (same order), and stats: tokens forwarded (real, padded), positions.

    workers > 1: that many batches at a time, torch on one thread each (models.data.distill_gen.map_batches).
    """
    need = [forward_length(y) for y in labels]
    if batch_tokens < max(need, default=0):
        raise ValueError(f"relabel batch_tokens={batch_tokens} is below the longest conversation ({max(need)} "
                         "tokens to forward); raise it")
    out: list[list[int] | None] = [None] * len(input_ids)
    stats = {"tokens": 0, "padded_tokens": 0, "positions": 0}
    batches = length_batches(need, batch_tokens)
    relabelled = map_batches(lambda batch: relabel_batch(model, [input_ids[i] for i in batch],
                                                         [labels[i] for i in batch], head_rows), batches, workers)
    for batch, new in zip(batches, relabelled):
        for i, y in zip(batch, new):
            out[i] = y
            stats["positions"] += sum(l != IGNORE_INDEX for l in y)
        stats["tokens"] += sum(need[i] for i in batch)
        stats["padded_tokens"] += len(batch) * max(need[i] for i in batch)
        if on_batch:
            on_batch(len(batch))
    return out, stats
