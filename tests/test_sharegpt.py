"""ShareGPT streaming reader on files cut at various byte offsets, on bad JSON, and on the real file."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from models.data.sharegpt import ReadStats, iter_json_array

REAL_FILE = Path(__file__).resolve().parent.parent / "artifacts/raw/ShareGPT_V3_unfiltered_cleaned_split.json"


def records(n: int) -> list[dict]:
    """Records with non-ASCII text, so byte offsets differ from character offsets."""
    return [{"id": f"r{i}_0", "conversations": [
        {"from": "human", "value": f"question {i}: café 日本語 ü"},
        {"from": "gpt", "value": f"answer {i}\n\twith \"quotes\" and \\ and 🎉", "meta": {"n": i, "x": [1, 2]}}]}
        for i in range(n)]


def build(recs: list[dict]) -> tuple[bytes, list[int], list[int]]:
    """The JSON array as bytes, with the byte offsets where each record starts and ends."""
    data, starts, ends = b"[\n", [], []
    for i, rec in enumerate(recs):
        starts.append(len(data))
        data += json.dumps(rec, indent=2, ensure_ascii=False).encode("utf-8")
        ends.append(len(data))
        data += b",\n" if i + 1 < len(recs) else b"\n]\n"
    return data, starts, ends


def read(path, caplog, **kw) -> tuple[list, ReadStats, list[logging.LogRecord]]:
    stats = ReadStats()
    with caplog.at_level(logging.WARNING, logger="models.data.sharegpt"):
        caplog.clear()
        out = list(iter_json_array(path, stats, **kw))
    return out, stats, [r for r in caplog.records if r.name == "models.data.sharegpt"]


# name -> (cut offset, first record lost, byte offset of the break) from (data, starts, ends)
CUTS = {
    "inside a string": lambda d, s, e: (d.index("日本".encode(), s[3]) + 1, 3, s[3]),
    "between records, after the comma": lambda d, s, e: (e[3] + 1, 4, e[3] + 1),
    "between records, before the comma": lambda d, s, e: (e[3], 4, e[3]),
    "inside a nested object": lambda d, s, e: (d.index(b'"n": 2', s[2]) + 5, 2, s[2]),
    "right after [": lambda d, s, e: (1, 0, 1),
    "inside a multi-byte character": lambda d, s, e: (d.index("🎉".encode(), s[5]) + 2, 5, s[5]),
}


@pytest.mark.parametrize("chunk_chars", [7, 1 << 20])
@pytest.mark.parametrize("name", list(CUTS))
def test_cut_file_yields_complete_records_and_warns_once(tmp_path, caplog, chunk_chars, name):
    recs = records(8)
    data, starts, ends = build(recs)
    cut, first_lost, break_at = CUTS[name](data, starts, ends)
    path = tmp_path / "cut.json"
    path.write_bytes(data[:cut])
    out, stats, warnings = read(path, caplog, chunk_chars=chunk_chars)
    assert out == recs[:first_lost]
    assert stats.records_recovered == first_lost
    assert stats.truncated_at_byte == break_at and stats.file_bytes == cut
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert f"{first_lost} complete records" in message and f"byte {break_at} " in message
    inside = break_at < cut
    assert stats.records_read == first_lost + inside
    assert stats.break_reason == ("cut off inside a record" if inside else "cut off between records")


def test_intact_file_reads_everything_without_warning(tmp_path, caplog):
    recs = records(5)
    path = tmp_path / "ok.json"
    path.write_bytes(build(recs)[0])
    out, stats, warnings = read(path, caplog, chunk_chars=5)
    assert out == recs and stats.truncated_at_byte is None and not warnings
    assert stats.records_read == stats.records_recovered == 5 and not stats.stopped_early


def test_max_records_stops_early_without_warning(tmp_path, caplog):
    path = tmp_path / "ok.json"
    path.write_bytes(build(records(6))[0][:-40])  # cut too, but never reached
    out, stats, warnings = read(path, caplog, max_records=3)
    assert len(out) == 3 and stats.stopped_early and not warnings


def test_numbers_split_across_chunks(tmp_path, caplog):
    path = tmp_path / "numbers.json"
    path.write_text("[12345, 678.9e1, true, null, \"s\", [1, 2], 42]")
    out, stats, warnings = read(path, caplog, chunk_chars=3)
    assert out == [12345, 6789.0, True, None, "s", [1, 2], 42] and not warnings


@pytest.mark.parametrize("text,n,reason", [
    ("", 0, "empty file"),
    ('{"id": 1}', 0, "expected '['"),
    ('[{"a": 1}, {"a": 2} {"a": 3}]', 2, "expected ','"),
    ('[{"a": 1}, {"a": nope}, {"a": 3}]', 1, "invalid JSON"),
    ('[{"a": 1},]', 1, "invalid JSON"),
])
def test_bad_json_never_raises(tmp_path, caplog, text, n, reason):
    path = tmp_path / "bad.json"
    path.write_text(text)
    out, stats, warnings = read(path, caplog)
    assert len(out) == n and len(warnings) == 1 and reason in stats.break_reason


@pytest.mark.slow
def test_real_sharegpt_file(caplog, smollm_dir):  # smollm_dir: builds the assets when missing
    out_count = 0
    stats = ReadStats()
    with caplog.at_level(logging.WARNING, logger="models.data.sharegpt"):
        for _ in iter_json_array(REAL_FILE, stats):
            out_count += 1
    assert out_count == stats.records_recovered == 17671
    assert stats.truncated_at_byte == 125506645 and stats.break_reason == "cut off inside a record"
    assert len([r for r in caplog.records if r.name == "models.data.sharegpt"]) == 1
