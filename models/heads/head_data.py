"""Batches for head training: conversations bucketed by length, or windows around sampled positions.

    data = HeadsDataset(input_ids, labels, hidden)                  # hidden: a HiddenCache or None
    train = conversation_loader(data, batch_positions=512, pad_id=2, shuffle=True, seed=42)
    train = window_loader(data, num_heads=4, batch_positions=512, pad_id=2, seed=42)   # needs the cache

Head k at position t predicts token t+k+2 and counts only where that token is an assistant token
(labels != -100). "Positions" below are head 0's targets: a sequence has as many as it has answer
tokens after its first two tokens (`target_positions`).

- Conversation batches (input_ids, labels [B, T] right-padded, hidden [B, T, h] from the cache):
  conversations sorted by length and cut into batches of about `batch_positions` positions, so
  the rows of a batch have similar lengths (little padding); the batch order is shuffled each
  epoch. Every family can train on them; the Hydra++ prefix layer and the Medusa-2 LoRA backbone
  must (they run over whole sequences), and so must a run without the hidden cache.
- Window batches (Medusa and Hydra on the hidden cache, whose heads read one position each):
  `batch_positions` positions drawn at random from all conversations; row i holds the cached h_t
  ([B, 1, h]) and the tokens x_t .. x_{t+K+1} with their labels ([B, K+2]: the Hydra path and the
  K targets), and `sources` [B, K+2] marks column 0 as the only position the heads read.
Both samplers draw from (seed, epoch), so a resumed epoch sees the same batches, and under DDP
each rank takes every world_size-th batch (the Trainer must not add its own sampler).
"""
from __future__ import annotations

import torch

IGNORE_INDEX = -100


def target_positions(labels) -> int:
    """Head 0's targets in one sequence: answer tokens at positions >= 2."""
    return sum(1 for y in labels[2:] if y != IGNORE_INDEX)


class HeadsDataset(torch.utils.data.Dataset):
    """Examples of (input_ids, labels) and, optionally, the cached base hidden states [T, h]."""

    def __init__(self, input_ids: list[list[int]], labels: list[list[int]], hidden=None):
        if hidden is not None and len(hidden) != len(input_ids):
            raise ValueError(f"hidden cache holds {len(hidden)} sequences, the data {len(input_ids)}")
        self.input_ids, self.labels, self.hidden = input_ids, labels, hidden

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict:
        item = {"input_ids": torch.as_tensor(self.input_ids[i]), "labels": torch.as_tensor(self.labels[i])}
        if self.hidden is not None:
            item["hidden"] = self.hidden[i]
        return item


def collate(items: list[dict], pad_id: int = 0) -> dict:
    """Right padding: input_ids/labels [B, T], hidden [B, T, h] when present.

    No attention mask: in a causal model a right-padded row's real tokens never see its pads.
    """
    T = max(len(x["input_ids"]) for x in items)
    B = len(items)
    out = {"input_ids": torch.full((B, T), pad_id, dtype=torch.long),
           "labels": torch.full((B, T), IGNORE_INDEX, dtype=torch.long)}
    if "hidden" in items[0]:
        out["hidden"] = torch.zeros((B, T, items[0]["hidden"].shape[-1]), dtype=items[0]["hidden"].dtype)
    for b, x in enumerate(items):
        n = len(x["input_ids"])
        out["input_ids"][b, :n] = x["input_ids"]
        out["labels"][b, :n] = x["labels"]
        if "hidden" in x:
            out["hidden"][b, :n] = x["hidden"]
    return out


def _rank_share(batches: list) -> list:
    """Under DDP: this rank's batches (every world_size-th, cut to the same count on every rank)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return batches
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    return batches[rank: len(batches) - len(batches) % world: world]


class LengthBatches(torch.utils.data.Sampler):
    """Conversations sorted by length, cut into batches of >= batch_positions positions (the last may hold fewer)."""

    def __init__(self, lengths: list[int], positions: list[int], batch_positions: int, shuffle: bool, seed: int = 0):
        if batch_positions < 1:
            raise ValueError(f"batch_positions must be >= 1, got {batch_positions}")
        self.batches, current, count = [], [], 0
        for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
            current.append(i)
            count += positions[i]
            if count >= batch_positions:
                self.batches.append(current)
                current, count = [], 0
        if current:
            self.batches.append(current)
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:     # Lightning calls it before every epoch
        self.epoch = epoch

    def __iter__(self):
        order = range(len(self.batches))
        if self.shuffle:
            order = torch.randperm(len(self.batches), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return iter(_rank_share([self.batches[int(i)] for i in order]))

    def __len__(self) -> int:
        return len(_rank_share(self.batches))


def conversation_loader(data: HeadsDataset, batch_positions: int, pad_id: int, shuffle: bool,
                        seed: int = 0) -> torch.utils.data.DataLoader:
    sampler = LengthBatches([len(x) for x in data.input_ids], [target_positions(y) for y in data.labels],
                            batch_positions, shuffle, seed)
    return torch.utils.data.DataLoader(data, batch_sampler=sampler, collate_fn=lambda items: collate(items, pad_id))


class PositionWindows(torch.utils.data.Dataset):
    """Every position t where some head has a target, as a window x_t .. x_{t+K+1}; dataset[list] is a batch."""

    def __init__(self, data: HeadsDataset, num_heads: int, pad_id: int):
        if data.hidden is None:
            raise ValueError("window batches read the hidden cache: build it (profile.train.hidden_cache=true) "
                             "or train on conversation batches")
        W = self.width = num_heads + 2
        lengths = torch.tensor([len(x) for x in data.input_ids])                          # [n]
        # the sequences laid end to end, each followed by W pads, so that no window reaches the next one
        self.ids = torch.cat([torch.tensor(list(x) + [pad_id] * W) for x in data.input_ids])              # [P]
        self.labels = torch.cat([torch.tensor(list(y) + [IGNORE_INDEX] * W) for y in data.labels])        # [P]
        seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths + W)                            # [P]
        seq_start = torch.cumsum(lengths + W, 0) - (lengths + W)                                          # [n]
        p = torch.nonzero(torch.arange(len(seq)) - seq_start[seq] < lengths[seq]).flatten()   # real tokens
        seen = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(self.labels != IGNORE_INDEX, 0)])
        has_target = seen[p + W] > seen[p + 2]                 # some label among x_{t+2} .. x_{t+K+1}
        self.starts = p[has_target]                            # window starts in the padded layout
        self.rows = self.starts - W * seq[self.starts]         # their rows in the cache (sequences end to end)
        self.hidden = data.hidden

    def __len__(self) -> int:
        return self.starts.numel()

    def __getitem__(self, index: list[int]) -> dict:
        j = torch.as_tensor(index)
        window = self.starts[j, None] + torch.arange(self.width)                        # [B, W]
        sources = torch.zeros(window.shape, dtype=torch.bool)
        sources[:, 0] = True
        return {"input_ids": self.ids[window], "labels": self.labels[window], "sources": sources,
                "hidden": self.hidden.rows(self.rows[j]).unsqueeze(1)}                   # [B, 1, h]


class WindowBatches(torch.utils.data.Sampler):
    """A fresh random order of all windows each epoch, cut into batches of batch_positions."""

    def __init__(self, num_windows: int, batch_positions: int, seed: int = 0):
        if batch_positions < 1:
            raise ValueError(f"batch_positions must be >= 1, got {batch_positions}")
        self.n, self.size, self.seed, self.epoch = num_windows, batch_positions, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        return iter(_rank_share([order[i:i + self.size] for i in range(0, self.n, self.size)]))

    def __len__(self) -> int:
        return len(_rank_share(list(range(0, self.n, self.size))))


def window_loader(data: HeadsDataset, num_heads: int, batch_positions: int, pad_id: int,
                  seed: int = 0) -> torch.utils.data.DataLoader:
    windows = PositionWindows(data, num_heads, pad_id)
    return torch.utils.data.DataLoader(windows, batch_size=None,
                                       sampler=WindowBatches(len(windows), batch_positions, seed))
