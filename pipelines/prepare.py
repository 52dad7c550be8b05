"""python -m pipelines.prepare [profile=smoke] [model=tiny_random] [profile.prepare.max_length=1024]

ShareGPT -> training conversations for the configured base model, streamed: memory holds one batch of
conversations (and the kept ids), never the whole file, so the peak does not grow with the data:
  1) stream the raw JSON (cut off mid-record: complete records kept, one warning)
  2) clean: drop malformed records, start at the first human turn, keep alternating pairs
  3) tokenise BATCH conversations at a time with the model's chat template, labels = assistant tokens
     only, cap at max_length; each batch goes at once to a staging Arrow file next to the output
  4) split train/val by conversation (ShareGPT's "<chat>_<part>" ids stay together), seeded, on the ids
  5) write a DatasetDict at data.prepared_dir, each split streamed from that file, and the counts, with
     the process's peak resident memory, at reports/metrics/prepare.json
"""
from __future__ import annotations

import json
import random
import resource
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
from datasets import Dataset, DatasetDict, Features, List, Value, config, load_from_disk
from datasets.arrow_writer import ArrowWriter
from omegaconf import DictConfig
from tqdm import tqdm

from models.data.conversations import IGNORE_INDEX, Cleaned, clean_record, tokenize_conversations
from models.data.sharegpt import ReadStats, iter_json_array
from pipelines.common import log, mlflow_run, run_record, stage, write_json

BATCH = 256  # conversations tokenised per call (and rows per record batch of the staging file)
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


@dataclass
class Tally:
    """What streaming keeps besides the rows (which go straight to disk): counts and the kept ids."""
    dropped: Counter = field(default_factory=Counter)
    events: Counter = field(default_factory=Counter)   # what cleaning trimmed from kept conversations
    ids: list[str] = field(default_factory=list)       # kept rows' ids in file order: all the split needs
    truncated: int = 0
    total_tokens: int = 0
    assistant_tokens: int = 0


def cleaned_conversations(records: Iterable, tally: Tally) -> Iterator[Cleaned]:
    """Step 2 over a stream of raw records: the kept conversations, ids made unique."""
    seen: Counter = Counter()
    for record in records:
        cleaned = clean_record(record)
        if cleaned.reason:
            tally.dropped[cleaned.reason] += 1
            continue
        tally.events.update(cleaned.events)
        seen[cleaned.id] += 1
        if seen[cleaned.id] > 1:  # ShareGPT reuses a few ids for different chats: keep ids unique
            cleaned.id = f"{cleaned.id}~{seen[cleaned.id] - 1}"
            tally.events["renamed_duplicate_id"] += 1
        yield cleaned


def tokenized_batches(tokenizer, conversations: Iterable[Cleaned], max_length: int, tally: Tally
                      ) -> Iterator[pa.Table]:
    """Step 3: the FEATURES rows of up to BATCH conversations at a time; a conversation with no
    assistant token left after the cap is dropped."""
    stream = iter(conversations)
    while batch := list(islice(stream, BATCH)):
        columns: dict[str, list] = {name: [] for name in FEATURES}
        for c, (ids, labels, cut) in zip(batch, tokenize_conversations(tokenizer, [c.messages for c in batch],
                                                                       max_length)):
            n_assistant = int(np.count_nonzero(np.asarray(labels) != IGNORE_INDEX))
            if n_assistant == 0:
                tally.dropped["no_assistant_tokens_after_truncation"] += 1
                continue
            tally.truncated += cut  # kept, but cut at max_length
            tally.ids.append(c.id)
            tally.total_tokens += len(ids)
            tally.assistant_tokens += n_assistant
            columns["id"].append(c.id)
            columns["messages"].append(json.dumps(c.messages, ensure_ascii=False))
            columns["input_ids"].append(ids)
            columns["labels"].append(labels)
        yield pa.Table.from_pydict(columns, schema=FEATURES.arrow_schema)


def write_arrow(path: Path, tables: Iterable[pa.Table]) -> None:
    """Write the tables one after the other to an Arrow file at path with datasets' own writer, as
    Dataset.save_to_disk does (same bytes for the same record batches)."""
    with ArrowWriter(features=FEATURES, path=str(path), embed_local_files=True) as writer:
        for table in tables:
            writer.write_table(table)
        writer.finalize()


def select_rows(path: Path, keep: list[bool], rows_per_table: int = config.DEFAULT_MAX_BATCH_SIZE
                ) -> Iterator[pa.Table]:
    """The rows of the Arrow stream file at path where keep is True, in order, rows_per_table at a time
    (save_to_disk's record batches). Read batch by batch, not memory-mapped: mapped pages count in the
    process's resident memory, by the end the whole file."""
    table, start = FEATURES.arrow_schema.empty_table(), 0
    with pa.OSFile(str(path)) as source:
        for batch in pa.ipc.open_stream(source):
            mask = keep[start:start + batch.num_rows]
            start += batch.num_rows
            if start > len(keep):
                raise ValueError(f"{path} holds more rows than the split's {len(keep)}")
            table = pa.concat_tables([table, pa.Table.from_batches([batch.filter(pa.array(mask, type=pa.bool_()))])])
            # cut only from more rows than a table: each is then a slice of a larger buffer, as save_to_disk's
            # slices of one in-memory table were, and the file's bytes are the same (distill hashes them)
            if table.num_rows > rows_per_table:
                table = table.combine_chunks()
            while table.num_rows > rows_per_table:
                yield table.slice(0, rows_per_table)
                table = table.slice(rows_per_table)
    if start != len(keep):
        raise ValueError(f"{path} holds {start} rows, the split {len(keep)}")
    if table.num_rows:
        yield table


def save_split(staging: Path, is_val: list[bool], out: Path) -> dict[str, int]:
    """Step 5 without loading the rows: datasets lays out a DatasetDict at out with one placeholder row
    per non-empty split (its own metadata files, which hold no row count), then each split's one data
    file is replaced by its rows streamed from the staging file. Rows per split returned."""
    sizes = {"train": is_val.count(False), "val": is_val.count(True)}
    placeholder = {"id": "", "messages": "", "input_ids": [], "labels": []}
    DatasetDict({name: Dataset.from_dict({k: [v] * min(n, 1) for k, v in placeholder.items()}, features=FEATURES)
                 for name, n in sizes.items()}).save_to_disk(str(out))
    for name, n in sizes.items():
        if not n:
            continue
        files = json.loads((out / name / "state.json").read_text())["_data_files"]
        if len(files) != 1:
            raise RuntimeError(f"datasets laid out {len(files)} data files for a one-row split, expected 1")
        write_arrow(out / name / files[0]["filename"], select_rows(staging, [v == (name == "val") for v in is_val]))
    reloaded = load_from_disk(str(out))  # maps the files, reads no rows
    if {name: len(reloaded[name]) for name in sizes} != sizes:
        raise RuntimeError(f"{out} does not load back with {sizes} rows")
    return sizes


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (1 << 20 if sys.platform == "darwin" else 1 << 10), 1)


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
    out = Path(cfg.data.prepared_dir)
    tmp, staging = out.with_name(out.name + ".tmp"), out.with_name(out.name + ".staging")
    for folder in (tmp, staging):  # leftovers of a killed run
        shutil.rmtree(folder, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        # 1) to 3) one pass: read, clean, tokenise, append to the staging Arrow file
        read, tally = ReadStats(), Tally()
        conversations = tqdm(cleaned_conversations(iter_json_array(raw, read, max_records=max_records), tally),
                             desc="clean+tokenise", unit="conv", mininterval=2.0)
        write_arrow(staging / "rows.arrow", tokenized_batches(tokenizer, conversations, max_length, tally))
        conversations.close()
        if read.records_recovered == 0:
            raise ValueError(f"no complete record could be read from {raw} ({read.break_reason}); "
                             "expected a JSON array of {\"id\", \"conversations\"} objects")
        log.info("read %d records (%d recovered), %d pass cleaning", read.records_read, read.records_recovered,
                 len(tally.ids) + tally.dropped["no_assistant_tokens_after_truncation"])
        if not tally.ids:
            raise ValueError(f"no conversation of {raw} survived cleaning and the cap of {max_length} tokens; "
                             f"dropped: {dict(tally.dropped)}")

        # 4) split by conversation; 5) write (a tmp folder renamed into place: a killed run leaves no half dataset)
        is_val = split_groups(tally.ids, float(cfg.data.val_fraction), int(cfg.seed))
        sizes = save_split(staging / "rows.arrow", is_val, tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    kept = len(tally.ids)
    stats = {
        "source": str(raw), "model": cfg.model.name, "max_length": max_length,
        "file_bytes": read.file_bytes, "records_read": read.records_read, "records_recovered": read.records_recovered,
        "truncated_at_byte": read.truncated_at_byte, "break_reason": read.break_reason,
        "stopped_early": read.stopped_early,
        "kept": kept, "dropped_total": sum(tally.dropped.values()), "dropped": dict(sorted(tally.dropped.items())),
        "trimmed": dict(sorted(tally.events.items())), "truncated": tally.truncated,
        "train": sizes["train"], "val": sizes["val"],
        "tokens": {"total": tally.total_tokens, "assistant": tally.assistant_tokens,
                   "mean_per_conversation": round(tally.total_tokens / kept, 1)},
        "wall_time_s": round(time.time() - t0, 1),
        "peak_rss_mb": peak_rss_mb(), "run": run_record(),
    }
    write_json(Path(cfg.paths.reports) / "metrics" / "prepare.json", stats)
    log.info("prepare: %d kept (train %d, val %d), %d dropped %s, %d truncated, %d tokens (%d assistant) in %.0f s, "
             "peak memory %.0f MB", kept, stats["train"], stats["val"], stats["dropped_total"], stats["dropped"],
             tally.truncated, tally.total_tokens, tally.assistant_tokens, stats["wall_time_s"], stats["peak_rss_mb"])
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
