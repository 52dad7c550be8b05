"""What the train stage feeds Lightning, apart from the stage so that a benchmark can build the same inputs
(pipelines/bench/joint.py): the examples cut to max_length, the draft vocabulary, the base's hidden-state caches,
the loaders over them, and fresh trainable heads.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from datasets import load_from_disk
from omegaconf import DictConfig

from models.shared import HeadsConfig
from models.methods import build_heads, method
from models.shared.draft_vocab import answer_token_counts, coverage, most_frequent
from models.shared.head_data import HeadsDataset, conversation_loader, window_loader
from models.shared.hidden_cache import HiddenCache, cache_key
from models.shared.training import IGNORE_INDEX
from pipelines.common import log
from pipelines.recipes import stage_heads


def load_examples(cfg: DictConfig) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """Per split (input_ids, labels) cut to max_length, keeping examples where head 0 has a target."""
    t = cfg.profile.train
    source = t.get("data", "distilled")
    if source not in ("distilled", "prepared"):
        raise ValueError(f"profile.train.data={source!r}: use distilled (self-distilled answers) or prepared")
    folder = Path(cfg.data.distilled_dir if source == "distilled" else cfg.data.prepared_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"{source} data {folder} does not exist; run `dvc repro {source[:-2] if source == 'prepared' else 'distill'}`"
                                " first (or set profile.train.data=prepared|distilled)")
    data, n = load_from_disk(str(folder)), int(t.max_length)
    limits = {"train": t.get("max_train_samples"), "val": t.get("max_val_samples")}
    out = {}
    for split in ("train", "val"):
        ids_list, labels_list = [], []
        for ids, labels in zip(data[split]["input_ids"], data[split]["labels"]):
            ids, labels = list(ids[:n]), list(labels[:n])
            if any(l != IGNORE_INDEX for l in labels[2:]):
                ids_list.append(ids)
                labels_list.append(labels)
            if limits[split] and len(ids_list) >= limits[split]:
                break
        if not ids_list:
            raise ValueError(f"no {split} example of {folder} has an assistant token past position 2 within "
                             f"max_length={n}")
        out[split] = (ids_list, labels_list)
    return out


def draft_vocabulary(cfg: DictConfig, data: dict, vocab_size: int) -> tuple[torch.Tensor | None, float]:
    """(draft_ids [Vd] or None, share of the val answer tokens inside): the most frequent train answer tokens."""
    size = cfg.profile.train.get("draft_vocab_size")
    if size is not None and int(size) >= vocab_size:
        log.info("draft_vocab_size=%s >= the model's vocabulary (%d): the heads score the full vocabulary", size, vocab_size)
        size = None
    if size is None:
        return None, 1.0
    ids = most_frequent(answer_token_counts(data["train"][1], vocab_size), int(size))
    return ids, coverage(ids, data["val"][1])


def taps_union(base_config, heads: list[tuple[str, int]]) -> tuple[int, ...]:
    """The sorted taps every one of these (family, num_layers) heads reads, each tap once."""
    return tuple(sorted({i for family, n in heads for i in method(family).family.taps(base_config, int(n))}))


def pipeline_taps(cfg: DictConfig, base_config) -> tuple[int, ...]:
    """The taps of the one hidden cache all train stages share: the union over cfg.pipeline_heads (each heads
    config as its own stage runs it, profile overrides merged) and cfg.heads (a stage outside that list)."""
    heads = [(str(cfg.heads.family), int(cfg.heads.num_layers))]
    for name in cfg.get("pipeline_heads") or []:
        other = stage_heads(cfg, str(name)).heads
        heads.append((str(other.family), int(other.num_layers)))
    return taps_union(base_config, heads)


def hidden_caches(cfg: DictConfig, model, data: dict) -> tuple[dict, float]:
    """({split: HiddenCache or None}, seconds): the base hidden states of every example, built once and reused
    (Medusa-2 uses them for its heads-only stage and as the adapters-off reference). The first train stage builds
    them with every tap of the pipeline (pipeline_taps, one key for all); each stage loads [final | its own taps]."""
    t, hidden, t0 = cfg.profile.train, {"train": None, "val": None}, time.time()
    own = method(cfg.heads.family).family.taps(model.config, int(cfg.heads.num_layers))    # EAGLE-3, DFlash: taps
    if t.get("hidden_cache", True):
        stored = pipeline_taps(cfg, model.config)
        log.info("hidden cache: taps %s stored (every train stage's), %s loaded for %s", list(stored), list(own),
                 cfg.heads.name)
        for split, (ids, _) in data.items():
            folder = Path(cfg.paths.results) / "cache" / "hidden" / cfg.model.name / cache_key(model, ids, taps=stored)
            hidden[split] = HiddenCache.build(model, ids, folder, batch_tokens=int(t.get("cache_batch_tokens", 4096)),
                                              desc=f"hidden cache {split}", taps=stored, load_taps=own)
    return hidden, time.time() - t0


def make_loader(cfg: DictConfig, data: dict, hidden: dict, pad: int):
    """loader(split, kind=None, limit=None): train on random positions of the cache (families that read one
    position each: family.window_recipes) or shuffled length buckets; val on length buckets."""
    h, family, batch_positions = cfg.heads, method(cfg.heads.family).family, int(cfg.profile.train.batch_positions)

    def loader(split, kind=None, limit=None):
        ids, labels = data[split]
        n = min(len(ids), limit or len(ids))
        cached = None if hidden[split] is None else hidden[split].first(n)
        ds = HeadsDataset(ids[:n], labels[:n], cached)
        if split == "train" and kind in family.window_recipes and cached is not None:
            return window_loader(ds, int(h.num_heads), batch_positions, pad, seed=int(cfg.seed))
        return conversation_loader(ds, batch_positions, pad, shuffle=split == "train", seed=int(cfg.seed))
    return loader


def trainable_heads(cfg: DictConfig, model, draft_ids: torch.Tensor | None):
    """Fresh heads of cfg.heads on `model` and the draft vocabulary, every parameter trainable (the Hydra++
    prefix layer is a copy of a frozen base layer)."""
    h = cfg.heads
    config = HeadsConfig.for_base(model, family=h.family, num_heads=int(h.num_heads), num_layers=int(h.num_layers),
                                  dropout=float(h.dropout), share_lm_head=bool(h.share_lm_head),
                                  draft_vocab_size=None if draft_ids is None else len(draft_ids),
                                  shared_blocks=h.get("shared_blocks", False), mask_token_id=h.get("mask_token_id"),
                                  sample_from_anchor=h.get("sample_from_anchor", False))
    return build_heads(config, model, draft_ids).requires_grad_(True)
