"""What a killed evaluation keeps: each finished (run, question), all its methods, written whole as it finishes.

    store = RecordStore(folder, fingerprint, settings)    # a new fingerprint discards the folder
    store.save(run, qid, QuestionResult(records, prompts, answers))
    store.load(run, qid, method_names, turns)             # -> the result, or None (missing, cut off, foreign)
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from models.measure.benchmark import TurnRecord

log = logging.getLogger("models.measure.records")


def _write_whole(path: Path, text: str, fsync: bool = True) -> None:
    """path.tmp, renamed onto path: the file is whole or absent, a .tmp is never read; fsync: on disk before the
    rename (the results a crash must not lose)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass
class QuestionResult:
    """One question in one run, all its methods: records[method] = its TurnRecords in turn order, prompts[t - 1]
    = turn t's input ids, answers = the baseline's answer texts (the history a later turn sees)."""
    records: dict[str, list[TurnRecord]]
    prompts: list[list[int]]
    answers: list[str]


def file_digest(path: Path) -> str | None:
    """sha256 of a file, or of every file under a folder with its relative name; None when it does not exist."""
    if not path.exists():
        return None
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


class RecordStore:
    """Finished (run, question) results as <folder>/r<run>-q<id>.json, each written whole (a temporary file,
    fsync, rename) as soon as its question is done, and manifest.json with the fingerprint they belong to.
    A new fingerprint discards the folder; a file that does not read back as a complete result of this
    fingerprint is redone; a temporary file is never read."""

    def __init__(self, folder: Path, fingerprint: str, settings: dict):
        self.folder, self.fingerprint = Path(folder), fingerprint
        manifest = self.folder / "manifest.json"
        try:
            old = json.loads(manifest.read_text()).get("fingerprint") if manifest.is_file() else None
        except ValueError:
            old = "unreadable"
        if old is not None and old != fingerprint:
            log.warning("evaluate settings, inputs or code changed (fingerprint %s -> %s): discarding the results "
                        "in %s", old, fingerprint, self.folder)
            shutil.rmtree(self.folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        _write_whole(manifest, json.dumps({"fingerprint": fingerprint, "settings": settings}, indent=2),
                     fsync=False)

    def path(self, run: int, qid: int) -> Path:
        return self.folder / f"r{run}-q{qid}.json"

    def save(self, run: int, qid: int, result: QuestionResult) -> None:
        body = {"fingerprint": self.fingerprint, "run": run, "question_id": qid, "prompts": result.prompts,
                "answers": result.answers,
                "records": {m: [r.as_dict(with_tokens=True) for r in recs] for m, recs in result.records.items()}}
        _write_whole(self.path(run, qid), json.dumps(body))    # the result is either complete or absent

    def load(self, run: int, qid: int, methods: list[str], turns: int) -> QuestionResult | None:
        """The stored result when it is complete and this fingerprint's, else None (logged: it is redone)."""
        path = self.path(run, qid)
        if not path.is_file():
            return None
        try:
            body = json.loads(path.read_text())
            result = QuestionResult({m: [TurnRecord.from_dict(r) for r in recs] for m, recs in body["records"].items()},
                                    body["prompts"], body["answers"])
            problem = self.problem(body, result, run, qid, methods, turns)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            problem = f"unreadable ({type(err).__name__}: {err})"
        if problem:
            log.warning("evaluate: %s is %s; redoing run %d question %d", path, problem, run, qid)
            return None
        return result

    def problem(self, body: dict, result: QuestionResult, run: int, qid: int, methods: list[str], turns: int):
        if body["fingerprint"] != self.fingerprint or (body["run"], body["question_id"]) != (run, qid):
            return "another run's or settings' result"
        if sorted(result.records) != sorted(methods) or len(result.prompts) != turns or len(result.answers) != turns:
            return f"incomplete (methods {sorted(result.records)}, {len(result.prompts)} turns)"
        for name, recs in result.records.items():
            if [(r.turn, r.run, r.question_id, r.method, r.new_tokens) for r in recs] != \
                    [(t, run, qid, name, len(r.tokens)) for t, r in enumerate(recs, 1)]:
                return f"inconsistent (method {name})"
        return None
