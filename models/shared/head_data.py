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
Every batch carries `index` [B]: the conversations (or windows) it holds.

Both samplers (ResumableBatches) draw the order from (seed, epoch) and count the batches handed out; the
loaders (ResumableLoader) give Lightning that state, so a run resumed mid-epoch goes on at the next unseen
batch. Under DDP each rank takes its share of every batch (the Trainer must not add its own sampler): an
epoch covers every example once over all ranks, and batch_positions counts positions per optimizer step.
"""
from __future__ import annotations

import abc
from collections import Counter

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
    """Right padding: input_ids/labels [B, T], hidden [B, T, h] when present, lengths [B] (each row's own tokens).

    No attention mask: in a causal model a right-padded row's real tokens never see its pads.
    """
    T = max(len(x["input_ids"]) for x in items)
    B = len(items)
    out = {"input_ids": torch.full((B, T), pad_id, dtype=torch.long),
           "labels": torch.full((B, T), IGNORE_INDEX, dtype=torch.long),
           "lengths": torch.tensor([len(x["input_ids"]) for x in items], dtype=torch.long)}
    if "hidden" in items[0]:
        out["hidden"] = torch.zeros((B, T, items[0]["hidden"].shape[-1]), dtype=items[0]["hidden"].dtype)
    for b, x in enumerate(items):
        n = len(x["input_ids"])
        out["input_ids"][b, :n] = x["input_ids"]
        out["labels"][b, :n] = x["labels"]
        if "hidden" in x:
            out["hidden"][b, :n] = x["hidden"]
    return out


def replica() -> tuple[int, int]:
    """(rank, world size) of this process: (0, 1) outside torch.distributed."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class ResumableBatches(torch.utils.data.Sampler, abc.ABC):
    """Batches of dataset indices in an order fixed by (seed, epoch), resumable mid-epoch.

    `offset` counts the batches handed out this epoch. Its state (seed, epoch, offset) goes into the
    checkpoints (ResumableLoader, training.LoaderState); after load_state_dict the next pass starts at batch
    `offset` of the same order, so a run killed mid-epoch neither repeats nor skips an example.
    Under DDP every rank walks the same global batches and takes rows rank, rank + world, ... of each:
    disjoint shares, as many batches on every rank, and about batch_positions positions per optimizer step
    whatever the world size.
    """

    def __init__(self, seed: int = 0):
        self.seed, self.epoch, self.offset = seed, 0, 0
        self._resume_at = 0

    @abc.abstractmethod
    def epoch_batches(self, epoch: int, world: int = 1) -> list[list[int]]:
        """The global batches of `epoch` (each holds at least `world` indices)."""

    def rank_batches(self, epoch: int, rank: int, world: int) -> list[list[int]]:
        """What rank `rank` of `world` trains on in `epoch`."""
        return [b[rank::world] for b in self.epoch_batches(epoch, world)]

    def set_epoch(self, epoch: int) -> None:     # Lightning calls it before every epoch
        if epoch != self.epoch:
            self.epoch, self.offset, self._resume_at = epoch, 0, 0

    def __iter__(self):
        rank, world = replica()
        start, self._resume_at = self._resume_at, 0        # a restored offset serves one pass only
        self.offset = start
        for batch in self.rank_batches(self.epoch, rank, world)[start:]:
            # counted as handed out: the loaders run in the main process (no workers reading ahead), and
            # Lightning fetches a sized loader's next batch only when it trains on it
            self.offset += 1
            yield batch

    def __len__(self) -> int:
        return len(self.epoch_batches(self.epoch, replica()[1]))

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"sampler state of seed {state['seed']} cannot resume a sampler of seed {self.seed}")
        self.epoch, self.offset, self._resume_at = state["epoch"], state["offset"], state["offset"]


class ResumableLoader(torch.utils.data.DataLoader):
    """A DataLoader over a ResumableBatches sampler, with the sampler's state_dict: Lightning counts it as
    resumable (no warning on a mid-epoch resume); training.fit_resumable saves and restores that state."""

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


class LengthBatches(ResumableBatches):
    """Conversations sorted by length, cut into batches of >= batch_positions positions (the last may hold fewer);
    the batch order is shuffled by (seed, epoch) when `shuffle`."""

    def __init__(self, lengths: list[int], positions: list[int], batch_positions: int, shuffle: bool, seed: int = 0):
        super().__init__(seed)
        if batch_positions < 1:
            raise ValueError(f"batch_positions must be >= 1, got {batch_positions}")
        self.order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
        self.positions, self.batch_positions, self.shuffle = positions, batch_positions, shuffle
        self._buckets: dict[int, list[list[int]]] = {}

    def buckets(self, world: int = 1) -> list[list[int]]:
        """The batches in length order; each holds at least `world` conversations, one for every rank."""
        if world not in self._buckets:
            if len(self.order) < world:
                raise ValueError(f"{len(self.order)} conversations cannot give each of {world} ranks one")
            out, current, count = [], [], 0
            for i in self.order:
                current.append(i)
                count += self.positions[i]
                if count >= self.batch_positions and len(current) >= world:
                    out.append(current)
                    current, count = [], 0
            if current and len(current) < world:       # too few for every rank: they join the last batch
                out[-1] = out[-1] + current
            elif current:
                out.append(current)
            self._buckets[world] = out
        return self._buckets[world]

    def epoch_batches(self, epoch: int, world: int = 1) -> list[list[int]]:
        batches = self.buckets(world)
        if not self.shuffle:
            return batches
        order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(self.seed + epoch))
        return [batches[int(i)] for i in order]


class ConversationBatches(torch.utils.data.Dataset):
    """dataset[list of conversation indices] -> their right-padded batch (collate), with their `index` [B]."""

    def __init__(self, data: HeadsDataset, pad_id: int):
        self.data, self.pad_id = data, pad_id

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: list[int]) -> dict:
        batch = collate([self.data[i] for i in index], self.pad_id)
        batch["index"] = torch.as_tensor(index, dtype=torch.long)
        return batch


def conversation_loader(data: HeadsDataset, batch_positions: int, pad_id: int, shuffle: bool,
                        seed: int = 0) -> ResumableLoader:
    sampler = LengthBatches([len(x) for x in data.input_ids], [target_positions(y) for y in data.labels],
                            batch_positions, shuffle, seed)
    return ResumableLoader(ConversationBatches(data, pad_id), batch_size=None, sampler=sampler)


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
                "hidden": self.hidden.rows(self.rows[j]).unsqueeze(1), "index": j}      # [B, 1, h]; [B]


class WindowBatches(ResumableBatches):
    """A fresh random order of all windows each epoch, cut into batches of batch_positions."""

    def __init__(self, num_windows: int, batch_positions: int, seed: int = 0):
        super().__init__(seed)
        if batch_positions < 1:
            raise ValueError(f"batch_positions must be >= 1, got {batch_positions}")
        self.n, self.size = num_windows, batch_positions

    def epoch_batches(self, epoch: int, world: int = 1) -> list[list[int]]:
        if self.n < world:
            raise ValueError(f"{self.n} positions cannot give each of {world} ranks one")
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
        batches = [order[i:i + self.size] for i in range(0, self.n, self.size)]
        if len(batches[-1]) < world:                    # too few for every rank: they join the batch before
            batches[-2].extend(batches.pop())
        return batches

    def __len__(self) -> int:                            # without drawing the permutation
        world, full = replica()[1], -(-self.n // self.size)
        return full - 1 if 0 < self.n % self.size < world else full


def window_loader(data: HeadsDataset, num_heads: int, batch_positions: int, pad_id: int,
                  seed: int = 0) -> ResumableLoader:
    windows = PositionWindows(data, num_heads, pad_id)
    return ResumableLoader(windows, batch_size=None, sampler=WindowBatches(len(windows), batch_positions, seed))


def unigram_baseline(train_labels, val_labels) -> float:
    """Top-1 of always guessing the most frequent training target, on head 0's val targets."""
    counts = Counter(l for labels in train_labels for l in labels[2:] if l != IGNORE_INDEX)
    top = counts.most_common(1)[0][0]
    targets = [l for labels in val_labels for l in labels[2:] if l != IGNORE_INDEX]
    return sum(l == top for l in targets) / max(1, len(targets))
