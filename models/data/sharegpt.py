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


def iter_json_array(path: str | Path, stats: ReadStats | None = None, max_records: int | None = None,
                    chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Yield each complete element of the JSON array in `path`; warn once where the file breaks."""
    path = Path(path)
    stats = stats if stats is not None else ReadStats()
    stats.file_bytes = path.stat().st_size
    decoder = json.JSONDecoder()
    # surrogateescape: any byte sequence decodes, and re-encodes to exactly the same bytes (offsets stay exact)
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
    buf, pos, buf_byte0, eof = "", 0, 0, False   # buf[0] sits at byte buf_byte0 of the file

    with open(path, "rb") as f:
        def refill() -> bool:
            """Drop the consumed part of buf, append one chunk; False at end of file."""
            nonlocal buf, pos, buf_byte0, eof
            if eof:
                return False
            buf_byte0 += len(buf[:pos].encode("utf-8", "surrogateescape"))
            raw = f.read(chunk_chars)
            eof = not raw
            buf, pos = buf[pos:] + utf8.decode(raw, final=eof), 0
            return not eof or bool(buf)

        def skip_ws() -> str:
            """Advance past whitespace (reading more as needed); the next character, '' at end of file."""
            nonlocal pos
            while True:
                pos = _SKIP_WS.match(buf, pos).end()
                if pos < len(buf):
                    return buf[pos]
                if not refill():
                    return ""

        def stop(reason: str) -> None:
            stats.truncated_at_byte = buf_byte0 + len(buf[:pos].encode("utf-8", "surrogateescape"))
            stats.break_reason = reason
            log.warning("%s breaks at byte %d of %d (%s): %d complete records recovered, the rest is ignored",
                        path.name, stats.truncated_at_byte, stats.file_bytes, reason, stats.records_recovered)

        # 1) the opening bracket
        first = skip_ws()
        if first != "[":
            stop("empty file" if first == "" else f"expected '[' at the start, found {first!r}")
            return
        pos += 1
        # 2) elements, each followed by ',' or the closing ']'
        expect_element = True
        while True:
            nxt = skip_ws()
            if nxt == "]" and (stats.records_read == 0 or not expect_element):
                return
            if not expect_element:
                if nxt != ",":
                    stop("cut off between records" if nxt == "" else f"expected ',' or ']', found {nxt!r}")
                    return
                pos += 1
                expect_element = True
                continue
            if nxt == "":
                stop("cut off between records")
                return
            if max_records is not None and stats.records_recovered >= max_records:
                stats.stopped_early = True
                return
            stats.records_read += 1
            while True:
                try:
                    record, end = decoder.raw_decode(buf, pos)
                    # a number may go on in the next chunk ("12" | "34", "1.5e" | "3"): wait for what ends it
                    if eof or isinstance(record, (dict, list, str, bool)) or record is None or (
                            end < len(buf) and buf[end] not in _NUMBER_CHARS):
                        break
                    refill()
                except json.JSONDecodeError as err:
                    # Incomplete in this buffer, or invalid: only the end of the file tells which.
                    if not refill():
                        cut = err.msg.startswith("Unterminated string") or not buf[err.pos:].strip()
                        stop("cut off inside a record" if cut else f"invalid JSON in a record: {err.msg}")
                        return
            pos, expect_element = end, False
            stats.records_recovered += 1
            yield record
