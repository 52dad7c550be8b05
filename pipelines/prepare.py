"""python -m pipelines.prepare [profile=smoke] [model=tiny_random] [profile.prepare.max_length=1024]

ShareGPT -> training conversations for the configured base model:
  1) stream the raw JSON (cut off mid-record: complete records kept, one warning)
  2) clean: drop malformed records, start at the first human turn, keep alternating pairs
  3) tokenise with the model's chat template, labels = assistant tokens only, cap at max_length
  4) split train/val by conversation (ShareGPT's "<chat>_<part>" ids stay together), seeded
  5) write a DatasetDict at data.prepared_dir and the counts at reports/metrics/prepare.json
"""
from __future__ import annotations

import json
import random
import shutil
import time
from collections import Counter
from pathlib import Path

import numpy as np
from datasets import Dataset, DatasetDict, Features, List, Value
from omegaconf import DictConfig
from tqdm import tqdm

from models.data.conversations import IGNORE_INDEX, clean_record, tokenize_conversations
from models.data.sharegpt import ReadStats, iter_json_array
from pipelines.common import log, mlflow_run, stage, write_json

BATCH = 256  # conversations tokenised per call
FEATURES = Features({"id": Value("string"), "messages": Value("string"),
                     "input_ids": List(Value("int64")), "labels": List(Value("int64"))})


def split_groups(ids: list[str], val_fraction: float, seed: int) -> list[bool]:
    """is_val per id: whole conversations ("<chat>_<part>" share <chat>) go to val, seeded, ~val_fraction of ids."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"data.val_fraction={val_fraction} must be in [0, 1)")
    groups: dict[str, list[int]] = {}
    for i, rid in enumerate(ids):
        groups.setdefault(rid.rsplit("_", 1)[0], []).append(i)
    order = sorted(groups)
    random.Random(seed).shuffle(order)
    target = round(val_fraction * len(ids))
    if val_fraction > 0 and target == 0 and len(groups) > 1:
        target = 1  # a small slice still gets a val split
    is_val, n_val = [False] * len(ids), 0
    for key in order[:-1]:  # the last group always stays in train
        if n_val >= target:
            break
        for i in groups[key]:
            is_val[i] = True
        n_val += len(groups[key])
    return is_val


def load_tokenizer(cfg: DictConfig):
    """The base model's tokenizer alone (prepare needs no weights), chat template as configured."""
    if cfg.model.tiny:
        from models.base import build_tiny_tokenizer
        tokenizer = build_tiny_tokenizer()
    else:
        from transformers import AutoTokenizer
        source = str(cfg.model.source)
        if source.startswith(("artifacts/", "./", "/")) and not Path(source).is_dir():
            raise FileNotFoundError(f"base model folder {source!r} does not exist; run `dvc repro assets` first, "
                                    "or pass model.source=<hub id or folder>")
        tokenizer = AutoTokenizer.from_pretrained(source)
    if cfg.model.chat_template:
        tokenizer.chat_template = cfg.model.chat_template
    if not tokenizer.chat_template:
        raise ValueError(f"tokenizer of {cfg.model.source!r} has no chat template; set model.chat_template")
    return tokenizer


def prepare_dataset(cfg: DictConfig) -> dict:
    """Steps 1) to 5); returns the stats also written to reports/metrics/prepare.json."""
    t0 = time.time()
    pcfg = cfg.profile.prepare
    max_length, max_records = int(pcfg.max_length), pcfg.get("max_conversations")
    raw = Path(cfg.data.raw_file)
    if not raw.is_file():
        raise FileNotFoundError(f"ShareGPT file {raw} does not exist; run `dvc repro assets` first "
                                "(or set data.raw_file=<path to a ShareGPT JSON array>)")
    tokenizer = load_tokenizer(cfg)

    # 1) + 2) one pass over the file: read and clean
    read = ReadStats()
    kept, dropped, events, seen = [], Counter(), Counter(), Counter()
    for record in iter_json_array(raw, read, max_records=max_records):
        cleaned = clean_record(record)
        if cleaned.reason:
            dropped[cleaned.reason] += 1
            continue
        events.update(cleaned.events)
        seen[cleaned.id] += 1
        if seen[cleaned.id] > 1:  # ShareGPT reuses a few ids for different chats: keep ids unique
            cleaned.id = f"{cleaned.id}~{seen[cleaned.id] - 1}"
            events["renamed_duplicate_id"] += 1
        kept.append(cleaned)
    if read.records_recovered == 0:
        raise ValueError(f"no complete record could be read from {raw} ({read.break_reason}); "
                         "expected a JSON array of {\"id\", \"conversations\"} objects")
    log.info("read %d records (%d recovered), %d pass cleaning", read.records_read, read.records_recovered, len(kept))

    # 3) tokenise in batches; drop what has no assistant token left after the cap
    rows, truncated = {"id": [], "messages": [], "input_ids": [], "labels": []}, 0
    total_tokens = assistant_tokens = 0
    with tqdm(total=len(kept), desc="tokenise", unit="conv", mininterval=2.0) as bar:
        for b in range(0, len(kept), BATCH):
            batch = kept[b:b + BATCH]
            for c, (ids, labels, cut) in zip(batch, tokenize_conversations(tokenizer, [c.messages for c in batch],
                                                                           max_length)):
                labels = np.asarray(labels, dtype=np.int32)  # [T]; int32 keeps 17k x 2 x 512 small in memory
                n_assistant = int((labels != IGNORE_INDEX).sum())
                if n_assistant == 0:
                    dropped["no_assistant_tokens_after_truncation"] += 1
                    continue
                truncated += cut  # kept, but cut at max_length
                rows["id"].append(c.id)
                rows["messages"].append(json.dumps(c.messages, ensure_ascii=False))
                rows["input_ids"].append(np.asarray(ids, dtype=np.int32))
                rows["labels"].append(labels)
                total_tokens += len(ids)
                assistant_tokens += n_assistant
            bar.update(len(batch))
    if not rows["id"]:
        raise ValueError(f"no conversation of {raw} survived cleaning and the cap of {max_length} tokens; "
                         f"dropped: {dict(dropped)}")

    # 4) split by conversation
    is_val = split_groups(rows["id"], float(cfg.data.val_fraction), int(cfg.seed))
    parts = {name: Dataset.from_dict({k: [v[i] for i in range(len(is_val)) if is_val[i] == (name == "val")]
                                      for k, v in rows.items()}, features=FEATURES)
             for name in ("train", "val")}

    # 5) write (a tmp folder renamed into place: a killed run leaves no half dataset)
    out = Path(cfg.data.prepared_dir)
    tmp = out.with_name(out.name + ".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    DatasetDict(parts).save_to_disk(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    stats = {
        "source": str(raw), "model": cfg.model.name, "max_length": max_length,
        "file_bytes": read.file_bytes, "records_read": read.records_read, "records_recovered": read.records_recovered,
        "truncated_at_byte": read.truncated_at_byte, "break_reason": read.break_reason,
        "stopped_early": read.stopped_early,
        "kept": len(rows["id"]), "dropped_total": sum(dropped.values()), "dropped": dict(sorted(dropped.items())),
        "trimmed": dict(sorted(events.items())), "truncated": truncated,
        "train": len(parts["train"]), "val": len(parts["val"]),
        "tokens": {"total": total_tokens, "assistant": assistant_tokens,
                   "mean_per_conversation": round(total_tokens / len(rows["id"]), 1)},
        "wall_time_s": round(time.time() - t0, 1),
    }
    write_json(Path(cfg.paths.reports) / "metrics" / "prepare.json", stats)
    log.info("prepare: %d kept (train %d, val %d), %d dropped %s, %d truncated, %d tokens (%d assistant) in %.0f s",
             stats["kept"], stats["train"], stats["val"], stats["dropped_total"], stats["dropped"], truncated,
             total_tokens, assistant_tokens, stats["wall_time_s"])
    return stats


def run_prepare(cfg: DictConfig) -> dict:
    """The stage inside its MLflow run: counts as metrics, prepare.json as artifact."""
    with mlflow_run(cfg, "prepare"):
        import mlflow

        stats = prepare_dataset(cfg)
        numbers = {k: v for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for group in ("dropped", "trimmed", "tokens"):
            numbers.update({f"{group}.{k}": v for k, v in stats[group].items()})
        mlflow.log_metrics({k: float(v) for k, v in numbers.items()})
        mlflow.log_artifact(str(Path(cfg.paths.reports) / "metrics" / "prepare.json"))
    return stats


@stage
def main(cfg: DictConfig) -> None:
    run_prepare(cfg)


if __name__ == "__main__":
    main()
