"""A resumable stage's time is the sum over the invocations its kept records took (pipelines.stage_clock)."""
from __future__ import annotations

import json
import time

from pipelines.common import STAGE_START
from pipelines.stage_clock import CLOCK_FILE, StageClock


def test_an_interrupted_stage_adds_each_invocations_time_and_a_finished_one_clears_its_clock(tmp_path, monkeypatch):
    monkeypatch.setitem(STAGE_START, "t", time.time() - 100.0)     # this invocation started 100 s ago
    first = StageClock(tmp_path)
    first.save()                                                  # a record kept, then the process was killed
    assert json.loads((tmp_path / CLOCK_FILE).read_text())["invocations"] == 1
    monkeypatch.setitem(STAGE_START, "t", time.time() - 30.0)      # resumed: 30 s so far
    second = StageClock(tmp_path)
    run = second.finish({"commit": "a", "wall_time_s": 30.0})
    assert run["invocations"] == 2 and 129.0 <= run["wall_time_s"] <= 135.0 and run["commit"] == "a"
    assert not (tmp_path / CLOCK_FILE).exists()                   # a later rerun counts only its own time
    monkeypatch.setitem(STAGE_START, "t", time.time() - 5.0)
    again = StageClock(tmp_path).finish({})
    assert again["invocations"] == 1 and again["wall_time_s"] < 10.0


def test_an_unreadable_clock_is_named_and_the_invocation_counts_alone(tmp_path, monkeypatch, caplog):
    (tmp_path / CLOCK_FILE).write_text('{"seconds": 12')
    monkeypatch.setitem(STAGE_START, "t", time.time() - 2.0)
    with caplog.at_level("WARNING", logger="pipelines"):
        run = StageClock(tmp_path).finish({})
    assert run["invocations"] == 1 and run["wall_time_s"] < 10.0
    assert CLOCK_FILE in caplog.text and "this invocation's time alone" in caplog.text
