"""``onceflow verify`` on the upsert sinks, end to end: events merged by key under faults while
another writer commits to the same table, checked per key by an independent reader."""

from __future__ import annotations

import re

import pytest

from verify_runs import run_verify

pytestmark = pytest.mark.slow


# the zombie runs on Delta only: the conformance suite's zombie chain covers iceberg-upsert
@pytest.mark.parametrize("sink, faults", [
    ("delta-upsert", ["concurrent_writer", "driver_kill", "zombie"]),
    ("iceberg-upsert", ["concurrent_writer", "driver_kill"]),
])
def test_upserts_survive_kills_and_another_writer_checked_per_key(tmp_path, sink, faults):
    """Events merged by key (key = id % K, every 11th id a delete); the check recomputes every
    key's last event from the ids, and reads the table's raw history (Delta log, Iceberg
    snapshots) for one decision per batch. Meanwhile another writer commits foreign rows to the
    same table: each of them must survive once."""
    rc, report, out = run_verify(tmp_path, "--seed", "7", "--sink", sink, "--faults", ",".join(faults),
                                 "--count", str(len(faults)), "--rate", "2000",
                                 "--events", "120000", "--any-time", "--outage-s", "8")
    assert rc == 0, out[-3000:]
    assert report["verdict"] == "exactly-once", out[-3000:]
    assert report["events_generated"] == report["events_committed"] > 4000  # keys present, one row each
    assert sorted(f["kind"] for f in report["fault_log"]) == faults, out[-3000:]
    assert "stale rows + batches not applied once" in out
    writer = next(f["detail"] for f in report["fault_log"] if f["kind"] == "concurrent_writer")
    m = re.search(r"(\d+) foreign commits \((\d+) rows, 0 failed\).*the job committed (\d+) batch", writer)
    assert m and int(m[1]) >= 10 and int(m[3]) >= 1, writer  # the two writers really raced
