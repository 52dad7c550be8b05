"""Cleaning rules, assistant-only labels, the seeded grouped split, the streamed writing, and the prepare stage
end to end."""
from __future__ import annotations

import functools
import json
import logging
import random
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pytest
from datasets import load_from_disk

import pipelines.prepare as prepare
from models.data.conversations import (IGNORE_INDEX, assistant_spans, clean_record, tokenize_conversation,
                                       tokenize_conversations)
from models.data.sharegpt import iter_json_array
from pipelines.prepare import FEATURES, prepare_dataset, run_prepare, select_rows, split_groups, write_arrow
from tests.fields import without


def H(text):
    return {"from": "human", "value": text}


def G(text):
    return {"from": "gpt", "value": text}


def rec(*turns, rid="c_0"):
    return {"id": rid, "conversations": list(turns)}


# ---------------------------------------------------------------------------------------------
# cleaning

DROPS = [
    ("not an object", ["a list"], "not_an_object"),
    ("missing conversations", {"id": "x_0"}, "missing_key"),
    ("missing id", {"conversations": [H("q"), G("a")]}, "missing_key"),
    ("turn missing value", rec({"from": "human"}, G("a")), "missing_key"),
    ("turn missing from", rec({"value": "q"}, G("a")), "missing_key"),
    ("id not a string", {"id": 7, "conversations": [H("q"), G("a")]}, "wrong_type"),
    ("conversations not a list", {"id": "x_0", "conversations": "q"}, "wrong_type"),
    ("turn not an object", rec(H("q"), "a"), "wrong_type"),
    ("value not a string", rec(H("q"), {"from": "gpt", "value": 42}), "wrong_type"),
    ("role not a string", rec(H("q"), {"from": None, "value": "a"}), "wrong_type"),
    ("no turns", rec(), "no_turns"),
    ("assistant only", rec(G("a"), G("b")), "no_human_turn"),
    ("assistant first, no reply", rec(G("a"), H("q")), "no_assistant_reply"),
    ("human only", rec(H("q")), "no_assistant_reply"),
    ("empty human turn", rec(H("  \n"), G("a")), "empty_turn"),
    ("empty reply", rec(H("q"), G("")), "empty_turn"),
    ("two human turns", rec(H("q"), H("q2"), G("a")), "non_alternating"),
    ("unknown role", rec(H("q"), {"from": "bing", "value": "a"}), "unknown_role"),
    ("lone surrogate", rec(H("q\ud800"), G("a")), "invalid_text"),
]


@pytest.mark.parametrize("record,reason", [d[1:] for d in DROPS], ids=[d[0] for d in DROPS])
def test_malformed_records_are_dropped_with_their_reason(record, reason):
    cleaned = clean_record(record)
    assert cleaned.messages is None and cleaned.reason == reason


KEEPS = [
    ("plain", rec(H("q"), G("a"), H("q2"), G("a2")), 4, []),
    ("assistant first", rec(G("intro"), H("q"), G("a")), 2, ["trimmed_leading_turns"]),
    ("system first", rec({"from": "system", "value": "s"}, H("q"), G("a")), 2, ["trimmed_leading_turns"]),
    ("trailing question", rec(H("q"), G("a"), H("q2")), 2, ["trimmed_trailing_user"]),
    ("empty turn later", rec(H("q"), G("a"), H(""), G("a2")), 2, ["cut_at_empty_turn"]),
    ("two replies", rec(H("q"), G("a"), G("a2"), H("q3"), G("a3")), 2, ["cut_at_non_alternating"]),
    ("other role names", rec({"from": "user", "value": "q"}, {"from": "chatgpt", "value": "a"}), 2, []),
]


@pytest.mark.parametrize("record,n_messages,events", [k[1:] for k in KEEPS], ids=[k[0] for k in KEEPS])
def test_kept_conversations_start_at_a_human_turn_and_alternate(record, n_messages, events):
    cleaned = clean_record(record)
    assert cleaned.reason is None and cleaned.events == events
    assert [m["role"] for m in cleaned.messages] == ["user", "assistant"] * (n_messages // 2)
    assert cleaned.messages[0]["content"] == "q" and cleaned.messages[1]["content"] == "a"


# ---------------------------------------------------------------------------------------------
# labels


def label_pieces(tokenizer, ids, labels) -> list[str]:
    """The decoded runs of labelled tokens, and a check that labels copy input_ids where set."""
    pieces, run = [], []
    for tok, lab in zip(ids, labels):
        if lab != IGNORE_INDEX:
            assert lab == tok
            run.append(tok)
        elif run:
            pieces.append(tokenizer.decode(run))
            run = []
    return pieces + ([tokenizer.decode(run)] if run else [])


CHAT = [{"role": "user", "content": "Hi there, café?"}, {"role": "assistant", "content": "Hello!\n\nHow can I help?"},
        {"role": "user", "content": "2+2"}, {"role": "assistant", "content": "  4 "}]


def test_labels_are_the_assistant_replies_and_their_end_of_turn(tiny_tokenizer):
    ids, labels, truncated = tokenize_conversation(tiny_tokenizer, CHAT, max_length=1000)
    assert not truncated and len(ids) == len(labels)
    assert tiny_tokenizer.decode(ids) == tiny_tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert label_pieces(tiny_tokenizer, ids, labels) == ["Hello!\n\nHow can I help?<|im_end|>", "  4 <|im_end|>"]


def test_truncation_keeps_a_prefix_of_the_full_labels(tiny_tokenizer):
    full_ids, full_labels, _ = tokenize_conversation(tiny_tokenizer, CHAT, max_length=1000)
    ids, labels, truncated = tokenize_conversation(tiny_tokenizer, CHAT, max_length=50)
    assert truncated and ids == full_ids[:50] and labels == full_labels[:50]
    ids, labels, truncated = tokenize_conversation(tiny_tokenizer, CHAT, max_length=10)
    assert truncated and all(x == IGNORE_INDEX for x in labels)  # the stage drops this one


def test_long_conversations_tokenised_from_a_prefix_match_the_full_text(tiny_tokenizer):
    rnd = random.Random(0)
    words = ["alpha", "béta", "  ", "\n", "日本", "x" * 40, "\t\t", "!!", "42"]
    convs = [[{"role": r, "content": "".join(rnd.choice(words) + " " for _ in range(rnd.randint(5, 3000)))}
              for r in ("user", "assistant", "user", "assistant")] for _ in range(6)]
    capped = tokenize_conversations(tiny_tokenizer, convs, max_length=300)
    full = tokenize_conversations(tiny_tokenizer, convs, max_length=10 ** 9)
    for (ids, labels, truncated), (full_ids, full_labels, _) in zip(capped, full):
        assert ids == full_ids[:300] and labels == full_labels[:300] and truncated == (len(full_ids) > 300)


def test_template_that_rewrites_earlier_messages_is_refused(tiny_tokenizer):
    tiny_tokenizer.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="does not render conversations incrementally"):
        assistant_spans(tiny_tokenizer, CHAT)


@pytest.mark.slow
def test_smollm_labels_skip_its_system_prompt_and_headers(smollm_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    chat = CHAT[:3] + [{"role": "assistant", "content": "4 "}]
    ids, labels, _ = tokenize_conversation(tokenizer, chat, max_length=512)
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.decode(ids)
    assert label_pieces(tokenizer, ids, labels) == ["Hello!\n\nHow can I help?<|im_end|>", "4 <|im_end|>"]
    # a reply that starts with whitespace: the header's "\n" merges into its first token, which is labelled
    ids, labels, _ = tokenize_conversation(tokenizer, CHAT, max_length=512)
    assert label_pieces(tokenizer, ids, labels)[1] == "\n  4 <|im_end|>"


# ---------------------------------------------------------------------------------------------
# split


def test_split_is_seeded_keeps_parts_together_and_has_a_val_side():
    ids = [f"chat{i}_{p}" for i in range(40) for p in range(i % 3 + 1)]
    a, b, c = split_groups(ids, 0.1, seed=42), split_groups(ids, 0.1, seed=42), split_groups(ids, 0.1, seed=1)
    assert a == b and a != c
    side = {}
    for rid, is_val in zip(ids, a):
        assert side.setdefault(rid.rsplit("_", 1)[0], is_val) == is_val
    assert 0.1 * len(ids) <= sum(a) <= 0.1 * len(ids) + 3
    assert sum(split_groups(ids[:3], 0.05, seed=0)) >= 1 and not any(split_groups(ids, 0.0, seed=0))
    with pytest.raises(ValueError, match="val_fraction"):
        split_groups(ids, 1.0, seed=0)


# ---------------------------------------------------------------------------------------------
# the stage


def write_cut_sharegpt(path: Path) -> dict:
    """24 good conversations + one of each kind of bad record, cut off inside a last record."""
    recs = []
    for i in range(24):
        turns = [H(f"question {i}?"), G(f"answer {i}, with some words"), H(f"and {i}?"), G(f"more {i}")]
        recs.append(rec(*(turns if i % 4 else [G("part two")] + turns), rid=f"chat{i // 2}_{i % 2}"))
    bad = [rec(), rec(G("a")), rec(H("q"), H("q2")), rec(H(""), G("a")), {"id": 3, "conversations": []},
           rec(H("q"), {"from": "gpt"}), rec(H("q" * 400), G("too late"))]  # the last: no reply token left at 128
    recs[5:5] = bad
    body = json.dumps(recs, indent=1, ensure_ascii=False)
    assert body.endswith("\n]")
    body = body[:-2] + ",\n "
    path.write_text(body + '{"id": "cut_0", "conversations": [{"from": "human", "value": "never fini', encoding="utf-8")
    return {"good": 24, "bad": len(bad), "break_at": len(body.encode("utf-8")), "records": recs}


@pytest.mark.slow
def test_prepare_end_to_end_on_a_small_cut_file(tmp_path, compose_cfg, mlflow_uri):
    raw = tmp_path / "sharegpt.json"
    expected = write_cut_sharegpt(raw)
    cfg = compose_cfg(f"data.raw_file={raw}", "profile.prepare.max_length=128", "data.val_fraction=0.2")
    stats = run_prepare(cfg)

    assert stats["records_recovered"] == expected["good"] + expected["bad"]
    assert stats["records_read"] == stats["records_recovered"] + 1
    assert stats["truncated_at_byte"] == expected["break_at"]
    assert stats["dropped"] == {"missing_key": 1, "no_turns": 1, "no_human_turn": 1, "non_alternating": 1,
                                "empty_turn": 1, "wrong_type": 1, "no_assistant_tokens_after_truncation": 1}
    assert stats["kept"] == 24 == stats["train"] + stats["val"] and stats["val"] > 0
    assert stats["trimmed"]["trimmed_leading_turns"] == 6
    assert json.loads((tmp_path / "reports/metrics/prepare.json").read_text()) == stats

    dataset = load_from_disk(cfg.data.prepared_dir)
    assert set(dataset) == {"train", "val"}
    assert dataset["train"].column_names == ["id", "messages", "input_ids", "labels"]
    groups = {name: {r.rsplit("_", 1)[0] for r in dataset[name]["id"]} for name in dataset}
    assert not groups["train"] & groups["val"]
    from models.base import build_tiny_tokenizer
    tokenizer = build_tiny_tokenizer()
    assistant_tokens = 0
    for row in dataset["train"]:
        messages = json.loads(row["messages"])
        assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
        assert len(row["input_ids"]) <= 128
        pieces = label_pieces(tokenizer, row["input_ids"], row["labels"])
        assert pieces == [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        assistant_tokens += sum(x != IGNORE_INDEX for x in row["labels"])
    assert assistant_tokens <= stats["tokens"]["assistant"]

    import mlflow
    runs = mlflow.search_runs(experiment_names=[cfg.mlflow.experiment], output_format="list")
    assert len(runs) == 1 and runs[0].data.tags["stage"] == "prepare"
    assert runs[0].data.metrics["kept"] == 24 and runs[0].data.metrics["dropped.no_turns"] == 1
    # a second run is deterministic
    stats2 = run_prepare(cfg)
    assert load_from_disk(cfg.data.prepared_dir)["val"]["id"] == dataset["val"]["id"]
    varies = ("wall_time_s", "peak_rss_mb", "date")         # the run record's date can cross a second between runs
    assert without(stats2, varies) == without(stats, varies) and stats2["run"]["commit"] == stats["run"]["commit"]
    assert 0 < stats["peak_rss_mb"] == runs[0].data.metrics["peak_rss_mb"]


def test_prepare_with_nothing_readable_says_so(tmp_path, compose_cfg):
    raw = tmp_path / "empty.json"
    raw.write_text("not json")
    with pytest.raises(ValueError, match="no complete record"):
        run_prepare(compose_cfg(f"data.raw_file={raw}"))
    with pytest.raises(FileNotFoundError, match="dvc repro assets"):
        run_prepare(compose_cfg(f"data.raw_file={tmp_path / 'missing.json'}"))


# ---------------------------------------------------------------------------------------------
# streaming


def test_streamed_rows_are_those_of_the_in_memory_reading_of_a_cut_file(tmp_path, compose_cfg, tiny_tokenizer,
                                                                       caplog, monkeypatch):
    monkeypatch.setattr(prepare, "BATCH", 5)  # several tokenised batches, the last one partial
    raw = tmp_path / "sharegpt.json"
    expected = write_cut_sharegpt(raw)
    cfg = compose_cfg(f"data.raw_file={raw}", "profile.prepare.max_length=128", "data.val_fraction=0.2")
    with caplog.at_level(logging.WARNING, logger="models.data.sharegpt"):
        stats = prepare_dataset(cfg)

    # the cut is reported once, with every complete record before it read
    assert stats["records_recovered"] == len(expected["records"]) and stats["break_reason"] == "cut off inside a record"
    assert stats["truncated_at_byte"] == expected["break_at"]
    assert [f"{len(expected['records'])} complete records" in r.getMessage() for r in caplog.records
            if r.name == "models.data.sharegpt"] == [True]
    # the rows: cleaning and tokenising each complete record in memory, then the same split
    rows = []
    for record in expected["records"]:
        cleaned = clean_record(record)
        if cleaned.reason is None:
            ids, labels, _ = tokenize_conversation(tiny_tokenizer, cleaned.messages, max_length=128)
            if any(x != IGNORE_INDEX for x in labels):
                rows.append({"id": cleaned.id, "messages": json.dumps(cleaned.messages, ensure_ascii=False),
                             "input_ids": ids, "labels": labels})
    is_val = split_groups([r["id"] for r in rows], 0.2, int(cfg.seed))
    dataset = load_from_disk(cfg.data.prepared_dir)
    assert dataset["train"].features == FEATURES == dataset["val"].features
    assert dataset["train"].to_list() == [r for r, v in zip(rows, is_val) if not v]
    assert dataset["val"].to_list() == [r for r, v in zip(rows, is_val) if v] != []
    assert (stats["train"], stats["val"]) == (len(dataset["train"]), len(dataset["val"]))
    out = Path(cfg.data.prepared_dir)
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no staging or tmp folder left


def test_select_rows_keeps_order_and_rebatches(tmp_path):
    path = tmp_path / "rows.arrow"
    tables = [pa.Table.from_pydict({"id": [f"c{i}_{j}" for j in range(3)], "messages": ["[]"] * 3,
                                    "input_ids": [[i, j] for j in range(3)], "labels": [[-100, j] for j in range(3)]},
                                   schema=FEATURES.arrow_schema) for i in range(5)]
    write_arrow(path, tables)
    keep = [i % 4 != 1 for i in range(15)]
    out = list(select_rows(path, keep, rows_per_table=4))
    assert [t.num_rows for t in out] == [4, 4, 3]
    assert pa.concat_tables(out).to_pylist() == [r for r, k in zip(pa.concat_tables(tables).to_pylist(), keep) if k]
    with pytest.raises(ValueError, match="more rows than the split's 14"):
        list(select_rows(path, keep[:-1]))
    with pytest.raises(ValueError, match="holds 15 rows, the split 16"):
        list(select_rows(path, keep + [True]))


def write_long_sharegpt(path: Path, n: int) -> int:
    """n one-pair conversations with 4 kB answers; the bytes each adds to the file."""
    recs = [rec(H(f"question {i}?"), G(f"answer {i}: " + "dolor sit " * 400), rid=f"chat{i}_0") for i in range(n)]
    path.write_text(json.dumps(recs))
    return path.stat().st_size // n


def test_memory_does_not_grow_with_the_number_of_conversations(tmp_path, compose_cfg, monkeypatch):
    """Python allocations (tracemalloc: strings, lists, numpy arrays) at two file sizes: the conversations
    themselves must not stay in memory (the in-memory prepare grew by about 6x each conversation's bytes)."""
    monkeypatch.setattr(prepare, "BATCH", 16)  # small batches and reads: the fixed part stays well below the growth
    monkeypatch.setattr(prepare, "iter_json_array", functools.partial(iter_json_array, chunk_chars=1 << 14))

    def traced_peak(n: int) -> int:
        raw = tmp_path / f"sharegpt{n}.json"
        write_long_sharegpt(raw, n)
        cfg = compose_cfg(f"data.raw_file={raw}", "profile.prepare.max_length=64")
        tracemalloc.start()
        try:
            assert prepare_dataset(cfg)["kept"] == n
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    traced_peak(40)  # warm-up: imports and caches of a first call
    small, large = traced_peak(40), traced_peak(200)
    bytes_per_conversation = write_long_sharegpt(tmp_path / "size.json", 1)
    assert (large - small) / (200 - 40) < 0.5 * bytes_per_conversation
