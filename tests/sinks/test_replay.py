"""The content digest a replayed task compares before skipping a committed partition."""

from __future__ import annotations

import datetime as dt
import decimal

import pyarrow as pa
import pytest

from onceflow.errors import ReplayMismatch
from onceflow.sinks.replay import ContentDigest, check_replay

COLUMNS = {
    "i": pa.array([1, 2, None, 4], pa.int32()),
    "f": pa.array([0.5, -1.0, 2.25, None]),
    "s": pa.array(["a", "", None, "dd"]),
    "b": pa.array([b"\x00", b"xy", b"", None]),
    "t": pa.array([dt.datetime(2026, 1, 1), None, dt.datetime(1970, 1, 1), dt.datetime(2030, 5, 5)]),
    "d": pa.array([decimal.Decimal("1.10"), None, decimal.Decimal("0"), decimal.Decimal("-3.5")]),
    "l": pa.array([[1], [], None, [2, 3]]),
    "k": pa.array(["x", "y", "x", None]).dictionary_encode(),
}


def digest(table: pa.Table, chunk: int = 1024) -> str:
    d = ContentDigest()
    for batch in table.to_batches(max_chunksize=chunk):
        d.update(batch)
    return d.hexdigest()


def test_the_same_rows_in_any_order_and_chunking_give_the_same_digest():
    table = pa.table(COLUMNS)
    assert digest(table) == digest(table.take([3, 1, 0, 2]), chunk=1) == digest(table, chunk=3)
    assert digest(table).startswith("4:")


@pytest.mark.parametrize("column", sorted(COLUMNS))
def test_a_changed_value_of_any_type_changes_the_digest(column):
    table = pa.table(COLUMNS)
    changed = table.set_column(table.column_names.index(column), column,
                               table.column(column).take([1, 1, 2, 3]))
    assert digest(changed) != digest(table)


def test_rows_moved_between_partitions_are_told_apart():
    ids = pa.table({"id": list(range(100))})
    assert digest(ids.slice(0, 50)) != digest(ids.take(list(range(1, 51))))
    assert digest(pa.table({"s": ["ab", "c"]})) != digest(pa.table({"s": ["a", "bc"]}))
    assert digest(pa.table({"x": [1], "y": [2]})) != digest(pa.table({"x": [2], "y": [1]}))


def test_check_replay_names_what_differs():
    same = dict(stored_fingerprint="fp", fingerprint="fp", stored_digest="4:ab", digest="4:ab")
    check_replay("sink", 3, 1, "lin", **same)
    check_replay("sink", 3, 1, "lin", **same | {"stored_digest": None})  # marker from before digests
    with pytest.raises(ReplayMismatch, match="other rows"):
        check_replay("sink", 3, 1, "lin", **same | {"digest": "4:ac"})
    with pytest.raises(ReplayMismatch, match="different source offsets"):
        check_replay("sink", 3, 1, "lin", **same | {"fingerprint": "fp2"})


def test_check_replay_names_the_committed_partitions_and_never_advises_an_earlier_fork():
    """Issue 28 point 2: following the advice must not duplicate the partitions already visible."""
    same = dict(stored_fingerprint="fp", fingerprint="fp", stored_digest="4:ab", digest="4:ab")
    committed = {0: 10, 3: 4}
    for change in ({"digest": "4:ac"}, {"fingerprint": "fp2"}):
        with pytest.raises(ReplayMismatch) as raised:
            check_replay("sink", 7, 3, "lin", **same | change, committed=committed)
        msg = str(raised.value)
        assert "partition(s) 0, 3 of batch 7 of lineage lin (14 rows) are already visible" in msg, msg
        assert "savepoint taken at or after batch 7" in msg and "Do NOT fork" in msg, msg
        assert "taken before this batch with --fork" not in msg
        assert "restart with 'onceflow run --from-savepoint SP --fork'" not in msg
    with pytest.raises(ReplayMismatch, match=r"partition\(s\) 3 of batch 7 .*\(2 rows\) are staged"):
        check_replay("sink", 7, 3, "lin", **same | {"digest": "2:00"}, committed={3: 2}, staged=True)
    with pytest.raises(ReplayMismatch, match=r"partition\(s\) 3 of batch 7 .*\(0 rows or more\)"):
        check_replay("sink", 7, 3, "lin", **same | {"digest": "2:00"})  # the sink knew no others
