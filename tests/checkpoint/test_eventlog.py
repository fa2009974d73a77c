"""The event log's offset reads (the supervisor tails the log from a driver's start)."""

from __future__ import annotations

from onceflow.checkpoint.eventlog import EventLog


def test_read_from_an_offset_returns_only_later_events(tmp_path):
    log = EventLog(str(tmp_path / "ckpt"))
    assert log.size() == 0 and list(log.read_from(0)) == []
    log.append("a")
    mark = log.size()
    log.append("b", n=1)
    log.append("c")
    assert [e["event"] for e in log.read_from(mark)] == ["b", "c"]
    assert [e["event"] for e in log.read_from(0)] == ["a", "b", "c"]
