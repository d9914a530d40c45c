"""Progress lines on a plain stream: one per interval, and ``close()`` writes the last state
unless the last line already showed it."""

from __future__ import annotations

import io
import logging

from tokenlake.benchmarks.progress import Progress


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tokenlake.progress"]


def test_close_writes_the_last_state_once(caplog):
    caplog.set_level(logging.INFO, logger="tokenlake.progress")
    p = Progress(4, "items", stream=io.StringIO(), every_s=0.0)
    p.update(2)
    p.update(4)  # the last line already says 4/4
    p.close()
    assert [line.split(" (")[0] for line in _lines(caplog)] == ["items: 2/4", "items: 4/4"]


def test_close_writes_what_the_interval_held_back(caplog):
    caplog.set_level(logging.INFO, logger="tokenlake.progress")
    p = Progress(4, "items", stream=io.StringIO(), every_s=3600.0)
    p.update(1, force=True)
    p.update(3)  # within the interval: not written
    p.close()
    assert [line.split(" (")[0] for line in _lines(caplog)] == ["items: 1/4", "items: 3/4"]


def test_nothing_written_stays_quiet_at_close(caplog):
    caplog.set_level(logging.INFO, logger="tokenlake.progress")
    p = Progress(4, "items", stream=io.StringIO(), every_s=3600.0)
    p.update(4)
    p.close()
    assert _lines(caplog) == []
