"""python -m pipelines.distill [profile=smoke] [model=tiny_random] [profile.distill.relabel_positions=0]

Training data for the heads, in the base model's own words, from two sources (`source` column):
  - self (self-distillation, docs/reference.md#training-recipes): the user turns of prepared conversations are
    replayed through the base model with its chat template and the model's own answers replace the
    assistant turns (a later user turn sees the model's earlier answers). Train and val rows.
  - relabel: more prepared TRAIN conversations run teacher-forced through the base model (no
    generation); each assistant label becomes the model's own argmax for that token, the input_ids
    stay ShareGPT's (models/data/relabel.py). Train rows only: val, what the heads are measured on, stays
    self-distilled. No conversation is in both sources.
  1) pick the work. self: the first conversations of each prepared split whose first prompt fits
     (profile.distill.num_conversations in all, val_conversations of them from val), ordered by
     first-prompt length so that each shard's batches hold prompts of similar length. relabel: the
     next train conversations not taken by self until relabel_positions answer positions (within
     relabel_max_length tokens, the training length) are covered.
  2) produce the missing shards (shard_size conversations each), self first: each finished shard is
     written to a temporary file and renamed into place, then its manifest is updated. A run killed at
     any point and started again skips the finished shards (a shard whose manifest entry a kill cut off
     is made again, its stats with it): no finished sample is lost and none is written twice. Shards
     live in data/distill-shards/<model.name>/{self,relabel}/, outside the DVC output (DVC deletes an
     output before it reruns the stage); each source has its own fingerprint, so changing one source's
     settings keeps the other's shards.
  3) tokenise the self conversations (assistant-only labels, profile.prepare.max_length), add the
     relabelled rows, write the DatasetDict at data.distilled_dir (prepare's columns + source) and
     reports/metrics/distill.json (rates, answer positions and conversations per source, shares).
With profile.distill.use_vllm and vLLM installed, self-distillation goes through vLLM instead.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset, DatasetDict, Features, Value, load_from_disk
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from models.data.conversations import IGNORE_INDEX, tokenize_conversations
from models.data.distill_gen import (GenerationSettings, HFGenerator, VLLMGenerator, chat_prompt, replay_conversations,
                                vllm_available)
from models.data.relabel import relabel_conversations
from models.data.shards import ShardStore, num_shards
from pipelines.common import flat_metrics, load_model, log, mlflow_run, run_record, stage, write_json
from pipelines.prepare import FEATURES, load_tokenizer

SPLITS = ("train", "val")
SOURCES = ("self", "relabel")
OUT_FEATURES = Features({**FEATURES, "source": Value("string")})
# What defines the samples of a source's shards; batch sizes, workers and use_vllm only change how they are produced.
SELF_KEYS = ("num_conversations", "val_conversations", "max_turns", "max_prompt_tokens", "max_new_tokens",
             "temperature", "top_p", "shard_size")
RELABEL_KEYS = ("relabel_positions", "relabel_max_length", "shard_size")


def user_turns(messages_json: str, max_turns: int | None) -> list[str]:
    turns = [m["content"] for m in json.loads(messages_json) if m["role"] == "user"]
    return turns[:max_turns] if max_turns else turns


def select_work(prepared: DatasetDict, tokenizer, num: int | None, max_turns: int | None, max_prompt_tokens: int,
                num_val: int | None = None) -> dict[str, list[tuple[str, list[str]]]]:
    """Per split, the first conversations (id, user turns) whose first prompt fits max_prompt_tokens,
    ordered by the length of that prompt (ties: prepared order).

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
        for row in (prepared[split].select_columns(["id", "messages"]) if sizes[split] else []):
            if len(chosen) >= want[split]:
                break
            turns = user_turns(row["messages"], max_turns)
            n = len(chat_prompt(tokenizer, [{"role": "user", "content": turns[0]}])) if turns else None
            if n is not None and n <= max_prompt_tokens:
                chosen.append((n, row["id"], turns))
        work[split] = [(cid, turns) for _, cid, turns in sorted(chosen, key=lambda c: c[0])]
    return work


def select_relabel(train: Dataset, exclude: set[str], positions: int, max_length: int) -> list[tuple[str, int]]:
    """(id, row index) of the first train conversations outside `exclude` until their answer positions
    (labels != -100 at 1 <= t < max_length) reach `positions`; fewer when the split runs out."""
    chosen, covered = [], 0
    for index, row in enumerate(train.select_columns(["id", "labels"])):
        if covered >= positions:
            break
        if row["id"] in exclude:
            continue
        n = int((np.asarray(row["labels"][1:max_length]) != IGNORE_INDEX).sum())
        if n:
            chosen.append((row["id"], index))
            covered += n
    if covered < positions:
        log.warning("relabel: the prepared train split holds %d answer positions outside self-distillation, "
                    "fewer than profile.distill.relabel_positions=%d", covered, positions)
    return chosen


def dataset_digest(ds) -> str:
    """sha256 of a saved dataset's Arrow files (its public cache_files): what the shards were made from."""
    h = hashlib.sha256()
    for entry in ds.cache_files:
        with open(entry["filename"], "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def fingerprint_of(cfg: DictConfig, prepared: DatasetDict, keys: tuple[str, ...], **extra) -> tuple[str, dict]:
    d = OmegaConf.to_container(cfg.profile.distill, resolve=True)
    settings = {k: d.get(k) for k in keys}
    settings.update(model=cfg.model.name, source=str(cfg.model.source), dtype=cfg.model.dtype, seed=int(cfg.seed),
                    chat_template=cfg.model.chat_template,
                    prepared={s: dataset_digest(prepared[s]) for s in SPLITS if s in prepared}, **extra)
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16], settings


def make_generator(cfg: DictConfig):
    """(generator, tokenizer): vLLM when asked for and importable (it loads the weights itself), else transformers."""
    d = cfg.profile.distill
    settings = GenerationSettings(max_new_tokens=int(d.max_new_tokens), temperature=float(d.temperature),
                                  top_p=float(d.top_p), batch_size=int(d.batch_size), workers=int(d.get("workers") or 1))
    if d.use_vllm and not cfg.model.tiny:
        if vllm_available():
            log.info("generating with vLLM")
            tokenizer = load_tokenizer(cfg)
            return VLLMGenerator(str(cfg.model.source), tokenizer, settings, dtype=cfg.model.dtype), tokenizer
        log.warning("profile.distill.use_vllm is set but vllm is not importable: generating with transformers")
    model, tokenizer = load_model(cfg, device=device())
    return HFGenerator(model, tokenizer, settings), tokenizer


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def run_self(store: ShardStore, work: dict, generator, tokenizer, cfg: DictConfig) -> int:
    """Generate the missing self-distillation shards; returns how many were generated."""
    d, size = cfg.profile.distill, int(cfg.profile.distill.shard_size)
    todo = [(s, i) for s in SPLITS for i in range(num_shards(len(work[s]), size)) if not store.done(s, i)]
    n_turns = sum(len(t) for s, i in todo for _, t in work[s][i * size:(i + 1) * size])
    with tqdm(total=n_turns, desc="distill self", unit="answer", mininterval=5.0) as bar:
        for split, index in todo:
            chunk = work[split][index * size:(index + 1) * size]
            ts = time.time()
            seed = int(cfg.seed) * 1_000_003 + (500_000 if split == "val" else 0) + index
            convs, stats = replay_conversations(generator, tokenizer, [turns for _, turns in chunk],
                                                int(d.max_prompt_tokens), seed=seed, on_batch=bar.update)
            records = [{"id": cid, "messages": msgs} for (cid, _), msgs in zip(chunk, convs)]
            store.write(split, index, records, {**stats, "seconds": round(time.time() - ts, 2)})
    return len(todo)


def run_relabel(store: ShardStore, work: list[tuple[str, int]], model, train: Dataset, cfg: DictConfig) -> int:
    """Relabel the missing shards of train conversations; returns how many were relabelled."""
    d, size = cfg.profile.distill, int(cfg.profile.distill.shard_size)
    max_length = int(d.relabel_max_length)
    todo = [i for i in range(num_shards(len(work), size)) if not store.done("train", i)]
    with tqdm(total=sum(len(work[i * size:(i + 1) * size]) for i in todo), desc="distill relabel", unit="conv",
              mininterval=5.0) as bar:
        for index in todo:
            chunk = work[index * size:(index + 1) * size]
            rows = train.select([i for _, i in chunk])
            ts = time.time()
            labels, stats = relabel_conversations(model, [list(x[:max_length]) for x in rows["input_ids"]],
                                                  [list(y[:max_length]) for y in rows["labels"]],
                                                  int(d.relabel_batch_tokens), workers=int(d.get("workers") or 1),
                                                  on_batch=bar.update)
            records = [{"id": cid, "labels": y} for (cid, _), y in zip(chunk, labels)]
            store.write("train", index, records, {**stats, "seconds": round(time.time() - ts, 2)})
    return len(todo)


def self_rows(records: list[dict], tokenizer, max_length: int) -> dict[str, list]:
    """Dataset columns of self-distilled conversations (those left without an answer token are dropped)."""
    rows = {"id": [], "messages": [], "input_ids": [], "labels": [], "source": []}
    convs = [r["messages"] for r in records]
    for rec, (input_ids, labels, _) in zip(records, tokenize_conversations(tokenizer, convs, max_length)
                                             if convs else []):
        if not any(l != IGNORE_INDEX for l in labels):
            continue
        rows["id"].append(rec["id"])
        rows["messages"].append(json.dumps(rec["messages"], ensure_ascii=False))
        rows["input_ids"].append(np.asarray(input_ids, dtype=np.int32))
        rows["labels"].append(np.asarray(labels, dtype=np.int32))
        rows["source"].append("self")
    return rows


def relabel_rows(records: list[dict], work: list[tuple[str, int]], train: Dataset, max_length: int
                 ) -> dict[str, list]:
    """Dataset columns of relabelled conversations: prepared input_ids and messages, the shards' labels."""
    rows = train.select([i for _, i in work])
    out = {"id": [], "messages": [], "input_ids": [], "labels": [], "source": []}
    for rec, cid, messages, input_ids in zip(records, rows["id"], rows["messages"], rows["input_ids"]):
        input_ids = input_ids[:max_length]
        if rec["id"] != cid or len(rec["labels"]) != len(input_ids):
            raise RuntimeError(f"relabel shard record {rec['id']!r} ({len(rec['labels'])} labels) does not match "
                               f"prepared row {cid!r} ({len(input_ids)} tokens); delete the relabel shards")
        out["id"].append(cid)
        out["messages"].append(messages)
        out["input_ids"].append(np.asarray(input_ids, dtype=np.int32))
        out["labels"].append(np.asarray(rec["labels"], dtype=np.int32))
        out["source"].append("relabel")
    return out


def split_counts(rows: dict[str, list], records: int) -> dict:
    """Conversations, tokens and answer positions of a split, in all and per source (with shares)."""
    positions = [int((l != IGNORE_INDEX).sum()) for l in rows["labels"]]
    total = sum(positions)
    by_source = {}
    for src in SOURCES:
        mine = [p for p, s in zip(positions, rows["source"]) if s == src]
        by_source[src] = {"conversations": len(mine), "answer_positions": sum(mine),
                          "share": round(sum(mine) / total, 4) if total else 0.0}
    return {"conversations": len(rows["id"]), "dropped_no_assistant_tokens": records - len(rows["id"]),
            "tokens": int(sum(len(x) for x in rows["input_ids"])), "answer_positions": total, **by_source}


def write_dataset(parts: dict[str, dict[str, list]], out: Path) -> None:
    """The DatasetDict written to a temporary folder and renamed into place."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    DatasetDict({s: Dataset.from_dict(rows, features=OUT_FEATURES) for s, rows in parts.items()}).save_to_disk(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def build_dataset(cfg: DictConfig, self_store: ShardStore, relabel_store: ShardStore, work: dict,
                  relabel_work: list, prepared, tokenizer) -> dict:
    """The distilled dataset from both sources' shards (relabelled conversations join train); -> counts per split."""
    d, max_length = cfg.profile.distill, int(cfg.profile.prepare.max_length)
    relabel_ids = [cid for cid, _ in relabel_work]
    parts, counts = {}, {}
    for split in SPLITS:
        records = self_store.read_all(split, [cid for cid, _ in work[split]])
        rows = self_rows(records, tokenizer, max_length)
        n_records = len(records)
        if split == "train" and relabel_work:
            more = relabel_rows(relabel_store.read_all("train", relabel_ids), relabel_work, prepared["train"],
                                int(d.relabel_max_length))
            rows = {k: rows[k] + more[k] for k in rows}
            n_records += len(relabel_ids)
        parts[split], counts[split] = rows, split_counts(rows, n_records)
    write_dataset(parts, Path(cfg.data.distilled_dir))
    return counts


def source_stats(self_store: ShardStore, relabel_store: ShardStore, self_now: int, relabel_now: int,
                 relabel_conversations: int) -> dict:
    """What each source's shards hold and cost, summed over their manifests."""
    gen, rel = self_store.totals(), relabel_store.totals()
    return {
        "self": {"fingerprint": self_store.manifest["fingerprint"], "turns": gen.get("turns", 0),
                 "turns_dropped": gen.get("turns_dropped", 0), "answers_cut": gen.get("answers_cut", 0),
                 "new_tokens": gen.get("new_tokens", 0), "generation_s": round(gen.get("seconds", 0), 1),
                 "new_tokens_per_s": rate(gen.get("new_tokens", 0), gen.get("seconds", 0)),
                 "shards": len(self_store.manifest["shards"]), "shards_generated_now": self_now},
        "relabel": {"fingerprint": relabel_store.manifest["fingerprint"],
                    "conversations": relabel_conversations,
                    "tokens": rel.get("tokens", 0), "padded_tokens": rel.get("padded_tokens", 0),
                    "positions": rel.get("positions", 0), "relabel_s": round(rel.get("seconds", 0), 1),
                    "tokens_per_s": rate(rel.get("tokens", 0), rel.get("seconds", 0)),
                    "positions_per_s": rate(rel.get("positions", 0), rel.get("seconds", 0)),
                    "shards": len(relabel_store.manifest["shards"]), "shards_relabelled_now": relabel_now}}


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
    # 1) the work of both sources
    work = select_work(prepared, tokenizer, d.num_conversations, d.max_turns, int(d.max_prompt_tokens),
                       d.get("val_conversations"))
    taken = {cid for split in SPLITS for cid, _ in work[split]}
    relabel_work = select_relabel(prepared["train"], taken, int(d.relabel_positions or 0), int(d.relabel_max_length))
    shards = Path(cfg.paths.data) / "distill-shards" / cfg.model.name
    self_store = ShardStore(shards / "self", *fingerprint_of(cfg, prepared, SELF_KEYS))
    relabel_ids = [cid for cid, _ in relabel_work]
    relabel_store = ShardStore(shards / "relabel", *fingerprint_of(
        cfg, prepared, RELABEL_KEYS, ids=hashlib.sha256("\n".join(relabel_ids).encode()).hexdigest()), parts=("train",))
    log.info("distill: self %d conversations (train %d, val %d), relabel %d train conversations; shards of %d",
             len(work["train"]) + len(work["val"]), len(work["train"]), len(work["val"]), len(relabel_work),
             int(d.shard_size))
    # 2) the missing shards: self first, then relabel (with the same model unless vLLM generated)
    self_now = run_self(self_store, work, generator, tokenizer, cfg)
    relabel_now = 0
    if relabel_work:
        model = generator.model if isinstance(generator, HFGenerator) else None
        del generator
        if model is None:
            model, _ = load_model(cfg, device=device())
        relabel_now = run_relabel(relabel_store, relabel_work, model, prepared["train"], cfg)
    # 3) the dataset
    counts = build_dataset(cfg, self_store, relabel_store, work, relabel_work, prepared, tokenizer)
    result = {"model": cfg.model.name, **counts, **source_stats(self_store, relabel_store, self_now, relabel_now, len(relabel_work)),
              "wall_time_s": round(time.time() - t0, 1), "run": run_record()}
    write_json(Path(cfg.paths.reports) / "metrics" / "distill.json", result)
    log.info("distill: %s", result)
    return result


def rate(n: float, seconds: float) -> float | None:
    return round(n / seconds, 1) if seconds else None



@stage
def main(cfg: DictConfig) -> None:
    with mlflow_run(cfg, "distill"):
        import mlflow

        stats = run_distill(cfg)
        mlflow.log_metrics(flat_metrics(stats))
        mlflow.log_artifact(str(Path(cfg.paths.reports) / "metrics" / "distill.json"))


if __name__ == "__main__":
    main()
