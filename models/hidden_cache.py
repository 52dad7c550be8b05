"""Frozen-backbone hidden-state cache: the base model's final hidden states, computed once.

    key = cache_key(model, sequences)                      # data + model + lengths: any change -> new key
    cache = HiddenCache.build(model, sequences, Path("results/cache/hidden") / name / key / "train")
    cache[i]                                               # [T_i, h] float32, what the LM head consumes

Medusa-1, Hydra and Hydra++ train on a frozen backbone, so its hidden states do not change between
families or epochs: one forward pass over the data serves them all. Shards of `shard_size`
sequences are written as safetensors (a temporary file renamed into place), so an interrupted
build resumes at the first missing shard. The whole cache is then held in memory (about
T x h x 4 bytes: 60 MB for 25k tokens of SmolLM2); at paper scale keep `profile.train.hidden_cache`
off and let the modules run the frozen backbone instead.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm


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


def cache_key(model, sequences: list[list[int]], dtype: torch.dtype = torch.float32) -> str:
    """16 hex digits naming the cache of `sequences` (already cut to max_length) under `model`."""
    text = f"{model_fingerprint(model)}:{sequences_fingerprint(sequences)}:{dtype}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@torch.no_grad()
def final_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] right-padded -> [B, T, h]: the decoder's output after the final norm."""
    return model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class HiddenCache:
    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tensors[i]

    @classmethod
    def build(cls, model, sequences: list[list[int]], folder: str | Path, batch_size: int = 8, shard_size: int = 256,
              dtype: torch.dtype = torch.float32, desc: str = "hidden cache") -> "HiddenCache":
        """Compute the missing shards, then load all of them."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        device = next(model.parameters()).device
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        n_shards = (len(sequences) + shard_size - 1) // shard_size
        missing = [s for s in range(n_shards) if not (folder / f"shard-{s:05d}.safetensors").is_file()]
        todo_tokens = sum(len(q) for s in missing for q in sequences[s * shard_size:(s + 1) * shard_size])
        with tqdm(total=todo_tokens, desc=desc, unit="tok", mininterval=5.0, disable=not missing) as bar:
            for s in missing:
                chunk = sequences[s * shard_size:(s + 1) * shard_size]
                out: list[torch.Tensor | None] = [None] * len(chunk)
                order = sorted(range(len(chunk)), key=lambda i: len(chunk[i]))   # similar lengths per batch
                for b in range(0, len(order), batch_size):
                    idx = order[b:b + batch_size]
                    width = max(len(chunk[i]) for i in idx)
                    ids = torch.full((len(idx), width), pad, dtype=torch.long)   # [B, T] right-padded
                    mask = torch.zeros((len(idx), width), dtype=torch.long)
                    for row, i in enumerate(idx):
                        ids[row, :len(chunk[i])] = torch.tensor(chunk[i])
                        mask[row, :len(chunk[i])] = 1
                    hidden = final_hidden(model, ids.to(device), mask.to(device))      # [B, T, h]
                    for row, i in enumerate(idx):
                        out[i] = hidden[row, :len(chunk[i])].to("cpu", dtype)
                    bar.update(int(mask.sum()))
                tmp = folder / f"shard-{s:05d}.safetensors.{os.getpid()}.tmp"   # DDP ranks may race: own tmp each
                save_file({"hidden": torch.cat(out), "lengths": torch.tensor([len(q) for q in chunk])}, str(tmp))
                tmp.replace(folder / f"shard-{s:05d}.safetensors")   # atomic: complete or absent
        tensors = []
        for s in range(n_shards):
            shard = load_file(str(folder / f"shard-{s:05d}.safetensors"))
            tensors += list(torch.split(shard["hidden"], shard["lengths"].tolist()))   # views, [T_i, h] each
        if [len(t) for t in tensors] != [len(q) for q in sequences]:
            raise RuntimeError(f"hidden cache {folder} does not match the data (lengths differ); delete it to rebuild")
        return cls(tensors)
