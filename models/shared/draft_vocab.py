"""Frequency-ranked draft vocabulary (FR-Spec; EAGLE-3 drafts over a subset of the vocabulary too).

    counts = answer_token_counts(train_labels, vocab_size)   # [V] how often each token is an answer token
    draft_ids = most_frequent(counts, size=4096)             # [Vd] token ids, most frequent first, ties by id
    coverage(draft_ids, val_labels)                          # share of the val answer tokens inside

The heads' LM heads score the draft vocabulary only ([h] -> [Vd] instead of [h] -> [V]): drafting and
training get cheaper by V / Vd, and a token outside the draft vocabulary is simply never proposed.
Verification keeps the base model's full vocabulary, so the decoded output does not change.
`size=None` stands for the full vocabulary (no draft vocabulary at all).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

IGNORE_INDEX = -100


def answer_token_counts(labels: Iterable[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """[V] int64: how many times each token id is a target (label != -100) in `labels`."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for row in labels:
        row = torch.as_tensor(row, dtype=torch.long)
        row = row[row != IGNORE_INDEX]
        if row.numel() and (int(row.min()) < 0 or int(row.max()) >= vocab_size):
            raise ValueError(f"label ids must lie in [0, {vocab_size}) or be {IGNORE_INDEX}; got "
                             f"min {int(row.min())}, max {int(row.max())}")
        counts += torch.bincount(row, minlength=vocab_size)
    return counts


def most_frequent(counts: torch.Tensor, size: int) -> torch.Tensor:
    """[size] int64: the `size` most frequent token ids, most frequent first; equal counts: the lower id first."""
    V = counts.numel()
    if not 1 <= size <= V:
        raise ValueError(f"draft vocabulary size {size} must be between 1 and the vocabulary size {V} "
                         "(or null for the full vocabulary)")
    return torch.argsort(-counts, stable=True)[:size]     # stable: ties keep increasing id order


def coverage(draft_ids: torch.Tensor | None, labels: Iterable[Sequence[int]]) -> float:
    """Share of the answer tokens (labels != -100) that lie in the draft vocabulary (1.0 for None = full)."""
    if draft_ids is None:
        return 1.0
    rows = [torch.as_tensor(row, dtype=torch.long) for row in labels]
    flat = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
    flat = flat[flat != IGNORE_INDEX]                                          # [n] answer tokens
    return float(torch.isin(flat, draft_ids.cpu()).float().mean()) if flat.numel() else float("nan")


def check_draft_ids(draft_ids: torch.Tensor, vocab_size: int, size: int, source: str = "draft vocabulary") -> None:
    """A draft vocabulary must be `size` distinct token ids of a `vocab_size`-token model."""
    if draft_ids.dim() != 1 or draft_ids.numel() != size or draft_ids.dtype.is_floating_point:
        raise ValueError(f"{source}: draft_ids must be {size} integer token ids, got a {draft_ids.dtype} tensor "
                         f"of shape {tuple(draft_ids.shape)}")
    if size and (int(draft_ids.min()) < 0 or int(draft_ids.max()) >= vocab_size):
        raise ValueError(f"{source}: draft vocabulary holds token ids in [{int(draft_ids.min())}, "
                         f"{int(draft_ids.max())}] but the base model has vocab_size={vocab_size}; "
                         "these heads were trained for another base model: train heads for this one")
    if torch.unique(draft_ids).numel() != size:
        raise ValueError(f"{source}: draft vocabulary lists some token ids twice")


def index_in_draft(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] int64: the position of each token id in draft_ids, -1 for tokens outside the draft vocabulary."""
    index = torch.full((vocab_size,), -1, dtype=torch.long, device=draft_ids.device)
    index[draft_ids] = torch.arange(draft_ids.numel(), device=draft_ids.device)
    return index


def vocab_maps(draft_ids: torch.Tensor | None, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [Vd], t2d bool [V]): draft index i is token i + d2t[i]; t2d marks the draft ids. The full
    vocabulary (None) is Vd = V with d2t zeros and t2d all true."""
    ids = torch.arange(vocab_size) if draft_ids is None else draft_ids.detach().long().cpu()
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(ids.numel()), t2d
