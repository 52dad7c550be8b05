"""Frozen-backbone hidden-state cache: the base model's final hidden states, computed once.

    key = cache_key(model, sequences)                      # data + model + lengths: any change -> new key
    cache = HiddenCache.build(model, sequences, Path("results/cache/hidden") / name / key / "train")
    cache[i]                                               # [T_i, h] float32, what the LM head consumes
    cache.rows(index)                                      # [n, h]: rows of the sequences laid end to end
    cache.first(n)                                         # the first n sequences' cache (a view)

Medusa-1, Hydra and Hydra++ train on a frozen backbone, so its hidden states do not change between
families or epochs: one forward pass over the data serves them all. The forward runs over the
sequences sorted by length, in batches of about `batch_tokens` tokens of near-equal length (little
padding) and without an attention mask (right padding: a causal model's real tokens never see the
pads), which is the fastest the decoder runs on a CPU. Shards of `shard_size` sequences (in that
length order) are written as safetensors (a temporary file renamed into place), so an interrupted
build resumes at the first missing shard. The whole cache is then held in memory as one float32
tensor: T x h x 4 bytes, 0.7 GB for 300k tokens of SmolLM2 (h = 576); at paper scale keep
`profile.train.hidden_cache` off and let the modules run the frozen backbone instead.

One cache serves families with different taps (EAGLE-3, DFlash): its shards hold [final | taps] for the union of
their taps (pipelines/train_inputs.py), and `load_taps` loads only [final | load_taps], in that order, each block of h
columns read straight from the shard file (safetensors slices), so the other taps never take memory.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from models.engine.taps import final_and_taps

LAYOUT = "length-sorted-v2"   # part of the key: shards of another layout are never read


def model_fingerprint(model) -> str:
    """Config plus checksums of the first and last weights: a re-converted or fine-tuned model gets a new one."""
    params = list(model.parameters())
    sums = [float(p.detach().double().sum()) for p in (params[0], params[len(params) // 2], params[-1])]
    text = json.dumps({"config": model.config.to_json_string(use_diff=False), "sums": sums}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def sequences_fingerprint(sequences: list[list[int]]) -> str:
    h = hashlib.sha256()
    for seq in sequences:
        h.update(torch.tensor(seq, dtype=torch.int64).numpy().tobytes())
        h.update(b"|")
    return h.hexdigest()


def cache_key(model, sequences: list[list[int]], dtype: torch.dtype = torch.float32, taps: tuple[int, ...] = ()) -> str:
    """16 hex digits naming the cache of `sequences` (already cut to max_length) under `model` (with these taps)."""
    text = f"{model_fingerprint(model)}:{sequences_fingerprint(sequences)}:{dtype}:{LAYOUT}"
    if taps:                                                  # the final-state-only key is unchanged
        text += f":taps={list(taps)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@torch.no_grad()
def final_hidden(model, input_ids: torch.Tensor, taps: tuple[int, ...] = ()) -> torch.Tensor:
    """[B, T] right-padded -> [B, T, h]: the decoder's output after the final norm (pads: ignore their rows); with
    taps, [B, T, h * (1 + len(taps))]: that state, then the taps (models/engine/taps.py)."""
    return final_and_taps(model.get_decoder(), input_ids, taps)


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive indices in batches whose padded size (rows x longest row) stays within batch_tokens
    (a longer sequence alone); on length-sorted sequences the rows of a batch have near-equal lengths."""
    batches, current, longest = [], [], 0
    for i, n in enumerate(lengths):
        if current and (len(current) + 1) * max(longest, n) > batch_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    return batches + [current] if current else batches


def column_runs(taps: tuple[int, ...], load_taps: tuple[int, ...]) -> list[tuple[int, int]]:
    """[(start, stop)] in blocks of h columns of a [final | taps] row that, laid side by side, give
    [final | load_taps]: block 0, then each load tap's place (consecutive blocks merged into one run)."""
    missing = [i for i in load_taps if i not in taps]
    if missing:
        raise ValueError(f"taps {missing} are not in this cache (its taps: {list(taps)})")
    runs: list[list[int]] = []
    for block in [0] + [1 + taps.index(i) for i in load_taps]:
        if runs and runs[-1][1] == block:
            runs[-1][1] += 1
        else:
            runs.append([block, block + 1])
    return [(a, b) for a, b in runs]


class HiddenCache:
    def __init__(self, flat: torch.Tensor, lengths: list[int]):
        self.flat = flat                                                       # [sum T_i, h]
        self.offsets = [0]
        for n in lengths:
            self.offsets.append(self.offsets[-1] + n)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> torch.Tensor:                           # [T_i, h], a view
        return self.flat[self.offsets[i]:self.offsets[i + 1]]

    def rows(self, index: torch.Tensor) -> torch.Tensor:                     # [n] -> [n, h]
        return self.flat[index]

    def first(self, n: int) -> "HiddenCache":
        """The cache of the first n sequences (a view)."""
        return HiddenCache(self.flat[:self.offsets[n]], [b - a for a, b in zip(self.offsets[:n], self.offsets[1:n + 1])])

    @classmethod
    def build(cls, model, sequences: list[list[int]], folder: str | Path, batch_tokens: int = 4096,
              shard_size: int = 256, dtype: torch.dtype = torch.float32, desc: str = "hidden cache",
              taps: tuple[int, ...] = (), load_taps: tuple[int, ...] | None = None) -> "HiddenCache":
        """Compute the missing shards, then load all of them into one tensor (the sequences in their own order).
        taps: each stored row also holds these base states after the final one (EAGLE-3: 4h floats a token).
        load_taps: the taps loaded after the final state, in this order, each one of taps (None: all of taps)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        device = next(model.parameters()).device
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        order = sorted(range(len(sequences)), key=lambda i: (len(sequences[i]), i))     # shortest first
        shards = [order[s:s + shard_size] for s in range(0, len(order), shard_size)]
        path = lambda s: folder / f"shard-{s:05d}.safetensors"
        missing = [s for s in range(len(shards)) if not path(s).is_file()]
        todo_tokens = sum(len(sequences[i]) for s in missing for i in shards[s])
        # 1) compute the missing shards
        with tqdm(total=todo_tokens, desc=desc, unit="tok", mininterval=5.0, disable=not missing) as bar:
            for s in missing:
                chunk = [sequences[i] for i in shards[s]]
                shard_rows, at = None, 0    # the shard's rows, filled in place: no second copy for a torch.cat
                for idx in length_batches([len(q) for q in chunk], batch_tokens):     # consecutive: rows in order
                    width = max(len(chunk[i]) for i in idx)
                    ids = torch.full((len(idx), width), pad, dtype=torch.long)        # [B, T] right-padded
                    for row, i in enumerate(idx):
                        ids[row, :len(chunk[i])] = torch.tensor(chunk[i])
                    hidden = final_hidden(model, ids.to(device), taps)                 # [B, T, h (+ taps)]
                    if shard_rows is None:
                        shard_rows = torch.empty(sum(len(q) for q in chunk), hidden.shape[-1], dtype=dtype)
                    for row, i in enumerate(idx):
                        shard_rows[at:at + len(chunk[i])] = hidden[row, :len(chunk[i])]
                        at += len(chunk[i])
                    bar.update(sum(len(chunk[i]) for i in idx))
                tmp = path(s).with_suffix(f".{os.getpid()}.tmp")           # DDP ranks may race: own tmp each
                save_file({"hidden": shard_rows, "index": torch.tensor(shards[s])}, str(tmp))
                tmp.replace(path(s))                                       # atomic: complete or absent
        # 2) load [final | load_taps] of them into one [sum T_i, h (+ load_taps)] tensor, each sequence at its place
        runs = column_runs(tuple(taps), tuple(taps if load_taps is None else load_taps))
        lengths = [len(q) for q in sequences]
        offsets = torch.cumsum(torch.tensor([0] + lengths), 0).tolist()
        flat = None
        for s in range(len(shards)):
            with safe_open(str(path(s)), framework="pt") as f:
                if f.get_tensor("index").tolist() != shards[s]:
                    raise RuntimeError(f"hidden cache {path(s)} does not match the data; delete {folder} to rebuild")
                stored = f.get_slice("hidden")
                h, extra = divmod(stored.get_shape()[-1], 1 + len(taps))
                if extra:
                    raise RuntimeError(f"hidden cache {path(s)} is not [final | {len(taps)} taps] wide; "
                                       f"delete {folder} to rebuild")
                parts = [stored[:, a * h:b * h] for a, b in runs]                      # only the loaded columns
                part = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
            if flat is None:
                flat = torch.empty(offsets[-1], part.shape[-1], dtype=part.dtype)
            for i, piece in zip(shards[s], torch.split(part, [lengths[i] for i in shards[s]])):
                flat[offsets[i]:offsets[i + 1]] = piece
        if flat is None:
            raise ValueError(f"no sequences to cache in {folder}")
        return cls(flat, lengths)
