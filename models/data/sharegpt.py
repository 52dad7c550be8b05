"""Streaming reader for a ShareGPT JSON array that may be cut off mid-record.

    stats = ReadStats()
    for record in iter_json_array("artifacts/raw/ShareGPT_V3_unfiltered_cleaned_split.json", stats):
        ...
    print(stats.records_recovered, stats.truncated_at_byte)

The file (a top-level `[ {...}, {...}, ...`) is read once, in chunks: each record is parsed with
json.JSONDecoder.raw_decode from a sliding text buffer, so memory holds about one chunk, not the
125 MB file. Where the file breaks (cut off, or bytes that are not JSON), every complete record
before the break has been yielded, one warning names the count and the byte offset where the
broken record starts, and iteration ends: the reader never raises on the content of the file.
"""
from __future__ import annotations

import codecs
import json
import logging
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("models.data.sharegpt")
_SKIP_WS = re.compile(r"\s*")
_NUMBER_CHARS = set("0123456789.eE+-")


@dataclass
class ReadStats:
    """What the reader saw; filled in while iterating."""
    file_bytes: int = 0
    records_read: int = 0          # records started, including a partial one at a break
    records_recovered: int = 0     # complete records yielded
    truncated_at_byte: int | None = None  # byte offset where the file stops being valid JSON; None: intact
    break_reason: str | None = None        # what was found there (e.g. "cut off inside a record")
    stopped_early: bool = False    # max_records reached before the end of the array

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _ArrayReader:
    """The state of one pass over a JSON array file: the decoded text buffer, the position in it and the byte
    offset of its start, so that a break is reported at its exact byte."""

    def __init__(self, f, path: Path, stats: ReadStats, chunk_chars: int):
        self.f, self.path, self.stats, self.chunk_chars = f, path, stats, chunk_chars
        # surrogateescape: any byte sequence decodes, and re-encodes to exactly the same bytes (offsets stay exact)
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
        self.buf, self.pos, self.buf_byte0, self.eof = "", 0, 0, False   # buf[0] sits at byte buf_byte0

    def refill(self) -> bool:
        """Drop the consumed part of buf, append one chunk; False at end of file."""
        if self.eof:
            return False
        self.buf_byte0 += len(self.buf[:self.pos].encode("utf-8", "surrogateescape"))
        raw = self.f.read(self.chunk_chars)
        self.eof = not raw
        self.buf, self.pos = self.buf[self.pos:] + self.utf8.decode(raw, final=self.eof), 0
        return not self.eof or bool(self.buf)

    def skip_ws(self) -> str:
        """Advance past whitespace (reading more as needed); the next character, '' at end of file."""
        while True:
            self.pos = _SKIP_WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.refill():
                return ""

    def stop(self, reason: str) -> None:
        s = self.stats
        s.truncated_at_byte = self.buf_byte0 + len(self.buf[:self.pos].encode("utf-8", "surrogateescape"))
        s.break_reason = reason
        log.warning("%s breaks at byte %d of %d (%s): %d complete records recovered, the rest is ignored",
                    self.path.name, s.truncated_at_byte, s.file_bytes, reason, s.records_recovered)

    def record(self, decoder: json.JSONDecoder):
        """(the element at pos, True), reading on as needed; (None, False) after stop() when it breaks."""
        while True:
            try:
                record, end = decoder.raw_decode(self.buf, self.pos)
                # a number may go on in the next chunk ("12" | "34", "1.5e" | "3"): wait for what ends it
                if self.eof or isinstance(record, (dict, list, str, bool)) or record is None or (
                        end < len(self.buf) and self.buf[end] not in _NUMBER_CHARS):
                    self.pos = end
                    return record, True
                self.refill()
            except json.JSONDecodeError as err:
                # Incomplete in this buffer, or invalid: only the end of the file tells which.
                if not self.refill():
                    cut = err.msg.startswith("Unterminated string") or not self.buf[err.pos:].strip()
                    self.stop("cut off inside a record" if cut else f"invalid JSON in a record: {err.msg}")
                    return None, False


def iter_json_array(path: str | Path, stats: ReadStats | None = None, max_records: int | None = None,
                    chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Yield each complete element of the JSON array in `path`; warn once where the file breaks."""
    path = Path(path)
    stats = stats if stats is not None else ReadStats()
    stats.file_bytes = path.stat().st_size
    decoder = json.JSONDecoder()
    with open(path, "rb") as f:
        r = _ArrayReader(f, path, stats, chunk_chars)
        # 1) the opening bracket
        first = r.skip_ws()
        if first != "[":
            r.stop("empty file" if first == "" else f"expected '[' at the start, found {first!r}")
            return
        r.pos += 1
        # 2) elements, each followed by ',' or the closing ']'
        expect_element = True
        while True:
            nxt = r.skip_ws()
            if nxt == "]" and (stats.records_read == 0 or not expect_element):
                return
            if not expect_element:
                if nxt != ",":
                    r.stop("cut off between records" if nxt == "" else f"expected ',' or ']', found {nxt!r}")
                    return
                r.pos += 1
                expect_element = True
                continue
            if nxt == "":
                r.stop("cut off between records")
                return
            if max_records is not None and stats.records_recovered >= max_records:
                stats.stopped_early = True
                return
            stats.records_read += 1
            record, ok = r.record(decoder)
            if not ok:
                return
            expect_element = False
            stats.records_recovered += 1
            yield record
