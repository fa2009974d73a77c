"""``onceflow verify --sink iceberg-upsert``'s independent check (before this branch neither the
sink kinds nor ``check_upserts`` existed: ImportError / an unknown-sink ConfigError).

The whole verify run with faults is measured in docs/iceberg-sink.md; here the check itself: a
correct final table passes, and each way an upsert sink can go wrong is counted."""

from __future__ import annotations

import pyarrow as pa
import pytest

from onceflow.verify.exactly_once import check_upserts
from onceflow.verify.spec import UPSERT_DELETE_EVERY, VerifySpec, checksum, payload, upsert_keys

EVENTS = 1000
K = upsert_keys(EVENTS)


def _table(rows: list[tuple[int, int]]) -> pa.Table:
    return pa.table({"key": pa.array([k for k, _ in rows], pa.int64()), "id": pa.array([i for _, i in rows], pa.int64()),
                     "payload": [payload(i) for _, i in rows], "checksum": [checksum(payload(i)) for _, i in rows]})


def _final() -> dict[int, int]:
    last = {i % K: i for i in range(EVENTS)}
    return {k: i for k, i in last.items() if i % UPSERT_DELETE_EVERY}


def test_a_correct_final_table_passes():
    report = check_upserts(_table(sorted(_final().items())), EVENTS, K, UPSERT_DELETE_EVERY, [0, 1, 2])
    assert report.ok and report.expected == len(_final()) < K, report


@pytest.mark.parametrize("fault, field", [
    ("stale", "state_errors"), ("resurrected", "unexpected"), ("twice", "duplicates"), ("lost", "missing"),
    ("batch_twice", "state_errors"), ("batch_never", "state_errors"), ("corrupt", "corrupted"),
])
def test_each_upsert_anomaly_is_counted(fault, field):
    rows = sorted(_final().items())
    decided = [0, 1, 2]
    k0, i0 = rows[0]
    if fault == "stale":  # an older event of the key (a batch re-applied after a newer one)
        rows[0] = (k0, i0 - K)
    elif fault == "resurrected":
        deleted = next(k for k in range(K) if k not in _final())
        rows.append((deleted, deleted + K * ((EVENTS - 1 - deleted) // K)))
    elif fault == "twice":
        rows.append(rows[0])
    elif fault == "lost":
        rows.pop(0)
    elif fault == "batch_twice":
        decided = [0, 1, 1, 2]
    elif fault == "batch_never":
        decided = [0, 2]
    table = _table(rows)
    if fault == "corrupt":
        table = table.set_column(2, "payload", pa.array(["x"] + table.column("payload").to_pylist()[1:]))
    report = check_upserts(table, EVENTS, K, UPSERT_DELETE_EVERY, decided)
    assert not report.ok and getattr(report, field) >= 1, report


def test_the_iceberg_sinks_are_verify_sinks(tmp_path):
    for sink in ("iceberg", "iceberg-upsert"):
        spec = VerifySpec(workdir=str(tmp_path), name="n1", sink=sink)
        assert spec.table == "verify.t_n1" and spec.iceberg_catalog.endswith("/iceberg/catalog.db")
