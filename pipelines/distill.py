"""python -m pipelines.distill [profile=smoke] [model=tiny_random] [profile.distill.num_conversations=64]

Self-distillation (REFERENCE.md section 2): the user turns of the prepared conversations are replayed
through the base model with its chat template, and the model's own answers replace the assistant
turns (a later user turn sees the model's earlier answers).
  1) pick the work: the first conversations of each prepared split whose first prompt fits
     (profile.distill.num_conversations in all, shared train/val in the prepared proportion)
  2) generate shard by shard (profile.distill.shard_size conversations; batched, progress bar); each
     finished shard is written to a temporary file and renamed into place, then the manifest is
     updated. A run killed at any point and started again skips the finished shards: no finished
     sample is lost and none is written twice. Shards live in data/distill-shards/<model.name>/,
     outside the DVC output (DVC deletes an output before it reruns the stage).
  3) tokenise (assistant-only labels, profile.prepare.max_length) and write the DatasetDict at
     data.distilled_dir in prepare's format, plus reports/metrics/distill.json.
With profile.distill.use_vllm and vLLM installed, generation goes through vLLM instead.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset, DatasetDict, load_from_disk
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from models.conversations import IGNORE_INDEX, tokenize_conversations
from models.distill_gen import (GenerationSettings, HFGenerator, VLLMGenerator, chat_prompt, replay_conversations,
                                vllm_available)
from pipelines.common import load_model, log, mlflow_run, stage, write_json
from pipelines.prepare import FEATURES, load_tokenizer

SPLITS = ("train", "val")
# What defines the samples of a shard; batch_size and use_vllm only change how they are produced.
SHARD_KEYS = ("num_conversations", "val_conversations", "max_turns", "max_prompt_tokens", "max_new_tokens", "temperature", "top_p",
              "shard_size")


def user_turns(messages_json: str, max_turns: int | None) -> list[str]:
    turns = [m["content"] for m in json.loads(messages_json) if m["role"] == "user"]
    return turns[:max_turns] if max_turns else turns


def select_work(prepared: DatasetDict, tokenizer, num: int | None, max_turns: int | None, max_prompt_tokens: int,
                num_val: int | None = None) -> dict[str, list[tuple[str, list[str]]]]:
    """Per split, the first conversations (id, user turns) whose first prompt fits max_prompt_tokens.

    num in all: num_val of them from val (None: val's share of the prepared data, at least 1).
    """
    sizes = {s: len(prepared[s]) if s in prepared else 0 for s in SPLITS}
    total = sum(sizes.values())
    if num is None or num >= total:
        want = dict(sizes)
    else:
        if num_val is None:
            num_val = max(1, round(num * sizes["val"] / max(total, 1)))
        n_val = min(sizes["val"], num_val, num)
        want = {"train": min(sizes["train"], num - n_val), "val": n_val}
    work = {}
    for split in SPLITS:
        chosen = []
        for row in (prepared[split] if sizes[split] else []):
            if len(chosen) >= want[split]:
                break
            turns = user_turns(row["messages"], max_turns)
            if turns and len(chat_prompt(tokenizer, [{"role": "user", "content": turns[0]}])) <= max_prompt_tokens:
                chosen.append((row["id"], turns))
        work[split] = chosen
    return work


class ShardStore:
    """Finished shards as <folder>/<split>/shard-NNNNN.jsonl plus manifest.json; a new fingerprint starts over."""

    def __init__(self, folder: Path, fingerprint: str, settings: dict):
        self.folder = Path(folder)
        manifest = self.folder / "manifest.json"
        old = json.loads(manifest.read_text()) if manifest.is_file() else None
        if old is not None and old.get("fingerprint") != fingerprint:
            log.warning("distill settings or data changed (fingerprint %s -> %s): discarding the shards in %s",
                        old.get("fingerprint"), fingerprint, self.folder)
            shutil.rmtree(self.folder)
            old = None
        self.manifest = old or {"fingerprint": fingerprint, "settings": settings, "shards": {}}
        for split in SPLITS:  # a shard renamed into place just before a kill, its manifest entry not yet written
            for path in sorted((self.folder / split).glob("shard-*.jsonl")):
                key = f"{split}/{path.stem}"
                if key not in self.manifest["shards"]:
                    ids = [json.loads(line)["id"] for line in path.read_text().splitlines()]
                    self.manifest["shards"][key] = {"n": len(ids), "ids": ids}
        self._write_manifest()

    def path(self, split: str, index: int) -> Path:
        return self.folder / split / f"shard-{index:05d}.jsonl"

    def done(self, split: str, index: int) -> bool:
        return self.path(split, index).is_file()

    def write(self, split: str, index: int, records: list[dict], stats: dict) -> None:
        path = self.path(split, index)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".jsonl.tmp")
        with open(tmp, "w") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)  # atomic: the shard is either complete or absent
        self.manifest["shards"][f"{split}/{path.stem}"] = {"n": len(records), "ids": [r["id"] for r in records],
                                                          **stats}
        self._write_manifest()

    def read(self, split: str, index: int) -> list[dict]:
        return [json.loads(line) for line in self.path(split, index).read_text().splitlines()]

    def _write_manifest(self) -> None:
        write_json(self.folder / "manifest.json", self.manifest)


def fingerprint_of(cfg: DictConfig, prepared: DatasetDict) -> tuple[str, dict]:
    d = cfg.profile.distill
    settings = {k: OmegaConf.to_container(d, resolve=True).get(k) for k in SHARD_KEYS}
    settings.update(model=cfg.model.name, source=str(cfg.model.source), dtype=cfg.model.dtype, seed=int(cfg.seed),
                    chat_template=cfg.model.chat_template,
                    prepared={s: prepared[s]._fingerprint for s in SPLITS if s in prepared})
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16], settings


def make_generator(cfg: DictConfig):
    """(generator, tokenizer): vLLM when asked for and importable (it loads the weights itself), else transformers."""
    d = cfg.profile.distill
    settings = GenerationSettings(max_new_tokens=int(d.max_new_tokens), temperature=float(d.temperature),
                                  top_p=float(d.top_p), batch_size=int(d.batch_size))
    if d.use_vllm and not cfg.model.tiny:
        if vllm_available():
            log.info("generating with vLLM")
            tokenizer = load_tokenizer(cfg)
            return VLLMGenerator(str(cfg.model.source), tokenizer, settings, dtype=cfg.model.dtype), tokenizer
        log.warning("profile.distill.use_vllm is set but vllm is not importable: generating with transformers")
    model, tokenizer = load_model(cfg, device="cuda" if torch.cuda.is_available() else "cpu")
    return HFGenerator(model, tokenizer, settings), tokenizer


def assemble(store: ShardStore, work: dict, tokenizer, max_length: int, out: Path) -> dict:
    """Read every shard, check ids against the work list, tokenise, write the DatasetDict atomically."""
    parts, counts = {}, {}
    for split in SPLITS:
        records = []
        for index in range(num_shards(len(work[split]), store.manifest["settings"]["shard_size"])):
            records += store.read(split, index)
        ids = [r["id"] for r in records]
        if ids != [cid for cid, _ in work[split]]:
            raise RuntimeError(f"distill shards of {split!r} in {store.folder} do not hold the expected "
                               f"conversations ({len(ids)} records, {len(set(ids))} unique, {len(work[split])} "
                               "expected); delete that folder to regenerate")
        rows = {"id": [], "messages": [], "input_ids": [], "labels": []}
        convs = [r["messages"] for r in records]
        for rec, (input_ids, labels, _) in zip(records, tokenize_conversations(tokenizer, convs, max_length)
                                                 if convs else []):
            if not any(l != IGNORE_INDEX for l in labels):
                continue
            rows["id"].append(rec["id"])
            rows["messages"].append(json.dumps(rec["messages"], ensure_ascii=False))
            rows["input_ids"].append(np.asarray(input_ids, dtype=np.int32))
            rows["labels"].append(np.asarray(labels, dtype=np.int32))
        parts[split] = Dataset.from_dict(rows, features=FEATURES)
        counts[split] = {"conversations": len(rows["id"]), "dropped_no_assistant_tokens": len(records) - len(rows["id"]),
                         "tokens": int(sum(len(x) for x in rows["input_ids"])),
                         "assistant_tokens": int(sum(int((l != IGNORE_INDEX).sum()) for l in rows["labels"]))}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    DatasetDict(parts).save_to_disk(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return counts


def num_shards(n: int, shard_size: int) -> int:
    return (n + shard_size - 1) // shard_size


def run_distill(cfg: DictConfig) -> dict:
    """Steps 1) to 3); returns the stats also written to reports/metrics/distill.json."""
    t0, d = time.time(), cfg.profile.distill
    if d.get("num_threads"):
        torch.set_num_threads(int(d.num_threads))
    prepared_dir = Path(cfg.data.prepared_dir)
    if not prepared_dir.is_dir():
        raise FileNotFoundError(f"prepared data {prepared_dir} does not exist; run `dvc repro prepare` "
                                "(or `python -m pipelines.prepare`) first")
    prepared = load_from_disk(str(prepared_dir))
    generator, tokenizer = make_generator(cfg)
    # 1) the work list
    work = select_work(prepared, tokenizer, d.num_conversations, d.max_turns, int(d.max_prompt_tokens),
                       d.get("val_conversations"))
    fingerprint, settings = fingerprint_of(cfg, prepared)
    store = ShardStore(Path(cfg.paths.data) / "distill-shards" / cfg.model.name, fingerprint, settings)
    shard_size = int(d.shard_size)
    todo = [(s, i) for s in SPLITS for i in range(num_shards(len(work[s]), shard_size)) if not store.done(s, i)]
    log.info("distill: %s conversations (train %d, val %d) in shards of %d; %d shards to generate, %d done",
             sum(len(w) for w in work.values()), len(work["train"]), len(work["val"]), shard_size, len(todo),
             len(store.manifest["shards"]))
    # 2) generate the missing shards
    n_turns = sum(len(t) for s, i in todo for _, t in work[s][i * shard_size:(i + 1) * shard_size])
    with tqdm(total=n_turns, desc="distill", unit="answer", mininterval=5.0) as bar:
        for split, index in todo:
            chunk = work[split][index * shard_size:(index + 1) * shard_size]
            ts = time.time()
            seed = int(cfg.seed) * 1_000_003 + (500_000 if split == "val" else 0) + index
            convs, stats = replay_conversations(generator, tokenizer, [turns for _, turns in chunk],
                                                int(d.max_prompt_tokens), seed=seed, on_batch=bar.update)
            records = [{"id": cid, "messages": msgs} for (cid, _), msgs in zip(chunk, convs)]
            store.write(split, index, records, {**stats, "seconds": round(time.time() - ts, 2)})
    # 3) the dataset
    counts = assemble(store, work, tokenizer, int(cfg.profile.prepare.max_length), Path(cfg.data.distilled_dir))
    shards = store.manifest["shards"].values()
    new_tokens, seconds = sum(s.get("new_tokens", 0) for s in shards), sum(s.get("seconds", 0) for s in shards)
    result = {"model": cfg.model.name, "fingerprint": fingerprint, **{s: counts[s] for s in SPLITS},
              "turns": sum(s.get("turns", 0) for s in shards), "turns_dropped": sum(s.get("turns_dropped", 0) for s in shards),
              "answers_cut": sum(s.get("answers_cut", 0) for s in shards), "new_tokens": new_tokens,
              "generation_s": round(seconds, 1), "new_tokens_per_s": round(new_tokens / seconds, 1) if seconds else None,
              "shards": len(store.manifest["shards"]), "shards_generated_now": len(todo),
              "wall_time_s": round(time.time() - t0, 1)}
    write_json(Path(cfg.paths.reports) / "metrics" / "distill.json", result)
    log.info("distill: %s", result)
    return result


@stage
def main(cfg: DictConfig) -> None:
    with mlflow_run(cfg, "distill"):
        import mlflow

        stats = run_distill(cfg)
        flat = {f"{s}.{k}": v for s in SPLITS for k, v in stats[s].items()}
        flat.update({k: v for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        mlflow.log_metrics({k: float(v) for k, v in flat.items()})
        mlflow.log_artifact(str(Path(cfg.paths.reports) / "metrics" / "distill.json"))


if __name__ == "__main__":
    main()
