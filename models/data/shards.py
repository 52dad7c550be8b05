"""Resumable generation in shards: each finished shard is written whole (temporary file, fsync, rename) with
its statistics in a manifest; a new fingerprint (settings or data changed) starts over.

    store = ShardStore(folder, fingerprint, settings)      # settings["shard_size"]: records per shard
    if not store.done("train", 3): store.write("train", 3, records, {"new_tokens": 812})
    records = store.read_all("train", expected_ids)        # every shard in order, checked against the ids
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger("models.data.shards")


def num_shards(n: int, shard_size: int) -> int:
    return (n + shard_size - 1) // shard_size


def jsonl_lines(path: Path) -> list[str]:
    """The lines of a JSONL file. Split on "\\n" only: str.splitlines() also splits on U+2028, U+0085 and
    other separators that json.dumps(ensure_ascii=False) writes raw inside strings (ShareGPT has them)."""
    return [line for line in path.read_text(encoding="utf-8").split("\n") if line]


class ShardStore:
    """Finished shards as <folder>/<part>/shard-NNNNN.jsonl plus manifest.json; a new fingerprint starts over."""

    def __init__(self, folder: Path, fingerprint: str, settings: dict, parts: tuple[str, ...] = ("train", "val")):
        self.folder, self.parts = Path(folder), parts
        manifest = self.folder / "manifest.json"
        old = json.loads(manifest.read_text()) if manifest.is_file() else None
        if old is not None and old.get("fingerprint") != fingerprint:
            log.warning("distill settings or data changed (fingerprint %s -> %s): discarding the shards in %s",
                        old.get("fingerprint"), fingerprint, self.folder)
            shutil.rmtree(self.folder)
            old = None
        self.manifest = old or {"fingerprint": fingerprint, "settings": settings, "shards": {}}
        for part in parts:  # a shard renamed into place just before a kill, its manifest entry (and the stats of
            # the report) not yet written: made again, so that the totals count every shard's stats
            for path in sorted((self.folder / part).glob("shard-*.jsonl")):
                if f"{part}/{path.stem}" not in self.manifest["shards"]:
                    log.warning("distill shard %s has no manifest entry (killed before its write): making it again",
                                path)
                    path.unlink()
        self._write_manifest()

    def path(self, part: str, index: int) -> Path:
        return self.folder / part / f"shard-{index:05d}.jsonl"

    def done(self, part: str, index: int) -> bool:
        return self.path(part, index).is_file()

    def write(self, part: str, index: int, records: list[dict], stats: dict) -> None:
        path = self.path(part, index)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:   # the shard is either complete or absent
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.manifest["shards"][f"{part}/{path.stem}"] = {"n": len(records), "ids": [r["id"] for r in records],
                                                         **stats}
        self._write_manifest()

    def read(self, part: str, index: int) -> list[dict]:
        return [json.loads(line) for line in jsonl_lines(self.path(part, index))]

    def read_all(self, part: str, expected_ids: list[str]) -> list[dict]:
        """Every shard of `part` in order; their ids must be expected_ids exactly."""
        records = []
        for index in range(num_shards(len(expected_ids), self.manifest["settings"]["shard_size"])):
            records += self.read(part, index)
        ids = [r["id"] for r in records]
        if ids != expected_ids:
            raise RuntimeError(f"distill shards of {part!r} in {self.folder} do not hold the expected conversations "
                               f"({len(ids)} records, {len(set(ids))} unique, {len(expected_ids)} expected); "
                               "delete that folder to regenerate")
        return records

    def totals(self) -> dict:
        """Sum of each numeric stat over the finished shards."""
        out: dict = {}
        for entry in self.manifest["shards"].values():
            for k, v in entry.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[k] = out.get(k, 0) + v
        return out

    def _write_manifest(self) -> None:
        path = self.folder / "manifest.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.manifest, indent=2) + "\n")
        os.replace(tmp, path)
