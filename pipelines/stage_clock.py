"""A resumable stage's wall time, summed over the invocations that made its records.

An evaluate stage resumes from its finished questions, the batch curve from its finished cells. Its run record
alone (pipelines.common.run_record) would give only the last invocation's time, so a run stopped and resumed
across sessions would read cheaper than it was. The clock keeps the seconds spent so far beside the records,
saved whenever a record is, and a finished stage reports the sum and how many invocations it took. What an
interrupted invocation spent after its last saved record (the unfinished question, redone on resume) is not
counted: the figure is the cost of the records kept.

    clock = StageClock(store_folder)         # after the store has discarded records of other settings
    ...; store.save(...); clock.save()
    metrics["run"] = clock.finish(run_record())
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from pipelines.common import STAGE_START, log, write_json

CLOCK_FILE = "stage_clock.json"


class StageClock:
    def __init__(self, folder: Path):
        self.path = Path(folder) / CLOCK_FILE
        before = self._read()
        self.before_s = float(before.get("seconds", 0.0))
        self.invocations = int(before.get("invocations", 0)) + 1
        self.start = STAGE_START.get("t") or time.time()

    def _read(self) -> dict:
        if not self.path.is_file():
            return {}
        try:
            return json.loads(self.path.read_text())
        except ValueError:     # written whole by write_json, so only a damaged disk gets here
            log.warning("%s does not read as the stage's clock: counting this invocation's time alone", self.path)
            return {}

    def seconds(self) -> float:
        return self.before_s + time.time() - self.start

    def save(self) -> None:
        write_json(self.path, {"seconds": round(self.seconds(), 1), "invocations": self.invocations})

    def finish(self, record: dict) -> dict:
        """The run record with the stage's time over all its invocations. The clock is then cleared: a later run
        that reads every record back costs only its own time."""
        out = {**record, "wall_time_s": round(self.seconds(), 1), "invocations": self.invocations}
        self.path.unlink(missing_ok=True)
        return out
