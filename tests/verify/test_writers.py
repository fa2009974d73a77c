"""verify's ``concurrent_writer`` fault: foreign rows written by another writer are set aside
before the exactly-once check, and each must survive exactly once."""

from __future__ import annotations

import pyarrow as pa

from onceflow.verify.writers import split_foreign


def _table(ids: list[int]) -> pa.Table:
    return pa.table({"id": pa.array(ids, pa.int64()), "payload": [f"p{i}" for i in ids],
                     "checksum": pa.array([0] * len(ids), pa.int64())})


def test_foreign_rows_are_set_aside_when_each_is_there_once():
    mine, problems = split_foreign(_table([0, -1, 1, -2, 2, -3]), [-1, -2, -3])
    assert mine.column("id").to_pylist() == [0, 1, 2] and problems == []


def test_a_lost_or_repeated_foreign_row_is_an_anomaly():
    _, problems = split_foreign(_table([0, -1, 1, -3, -3]), [-1, -2, -3])
    assert any("1 of 3 committed foreign rows are missing" in p for p in problems), problems
    assert any("1 foreign rows present more often" in p for p in problems), problems
    _, problems = split_foreign(_table([0, 1]), [-1, -2])
    assert problems and "2 committed foreign rows are missing" in problems[0]
    # a foreign row that was never (seen) committed is not the job's doing, but it is not allowed twice
    _, problems = split_foreign(_table([0, -4]), [-1])
    assert any("missing" in p for p in problems) and any("more often" in p for p in problems), problems


def test_no_writer_no_foreign_rows():
    mine, problems = split_foreign(_table([0, 1, 2]), [])
    assert mine.num_rows == 3 and problems == []
