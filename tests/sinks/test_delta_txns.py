"""The Delta sink's app transaction versions kept current from the log (``sinks/delta/txns.py``).

Issue 32: delta-rs reads every log entry since the last checkpoint again for each
``transaction_version`` call (one request each on an object store), which the sink makes in every
task and twice per decision; on a moto S3 server a decision took 54 -> 135 ms over 15 batches.
:class:`TrackedTable` reads each new entry once. What must hold: its answer is always delta-rs's
own at the table's current version, whoever committed (another writer, the table object itself,
several apps in one entry), and an unreadable entry costs speed, not correctness.
"""

from __future__ import annotations

import pyarrow as pa
import pytest
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from onceflow import storage
from onceflow.sinks.delta.txns import TrackedTable

APPS = ["a", "b", "c", "never"]


def _append(url: str, opts: dict, txns: dict[str, int]) -> None:
    props = CommitProperties(app_transactions=[Transaction(a, v) for a, v in txns.items()])
    write_deltalake(url, pa.table({"id": pa.array([1], pa.int64())}), mode="append",
                    storage_options=opts, commit_properties=props)


def _same_as_delta_rs(tracked: TrackedTable, url: str, opts: dict) -> None:
    tracked.update_incremental()
    fresh = DeltaTable(url, storage_options=opts)
    assert tracked.version() == fresh.version()
    assert {a: tracked.transaction_version(a) for a in APPS} == {a: fresh.transaction_version(a) for a in APPS}


@pytest.fixture(params=["local", "s3"])
def table_url(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "t"), {}
    s3 = request.getfixturevalue("s3")
    return f"s3://{s3.bucket()}/t", s3.options


def test_answers_are_delta_rs_own_whoever_commits(table_url):
    url, own = table_url
    target, opts = storage.delta_target(url, own)
    _append(target, opts, {})
    fs, root = storage.url_to_fs(url, own)
    tracked = TrackedTable(target, opts, fs, f"{root}/_delta_log")
    _same_as_delta_rs(tracked, target, opts)  # none yet
    _append(target, opts, {"a": 1})  # another writer
    _same_as_delta_rs(tracked, target, opts)
    _append(target, opts, {"a": 2, "b": 5})  # two apps in one entry
    _append(target, opts, {})  # an entry without a transaction
    _append(target, opts, {"c": 7})  # an app not asked before this entry
    _same_as_delta_rs(tracked, target, opts)
    _append(target, opts, {"a": 3})
    _append(target, opts, {"a": 4, "c": 8})  # several entries caught up at once
    _same_as_delta_rs(tracked, target, opts)
    props = CommitProperties(app_transactions=[Transaction("b", 6)])  # the table's own commit
    tracked.create_write_transaction([], "append", pa.schema(tracked.schema().to_arrow()), commit_properties=props)
    _same_as_delta_rs(tracked, target, opts)
    assert tracked.transaction_version("b") == 6


def test_an_unreadable_log_entry_falls_back_to_delta_rs(tmp_path):
    url = str(tmp_path / "t")
    _append(url, {}, {"a": 1})
    fs, _ = storage.url_to_fs(url)
    tracked = TrackedTable(url, {}, fs, str(tmp_path / "elsewhere"))  # every entry read fails
    assert tracked.transaction_version("a") == 1
    _append(url, {}, {"a": 2})
    _same_as_delta_rs(tracked, url, {})
    assert tracked.transaction_version("a") == 2


def test_the_sinks_checks_read_each_log_entry_once_on_an_object_store(s3):
    """Through the sink's own table view (``is_decided``, what every task asks, and the
    decisions): once the table is read, asking again reads no log entry, and each decision reads
    only the entries it brings. Before: every ask read every entry since the table's creation
    again (delta-rs's ``transaction_version``), 10 asks at 12 versions = 120 entry reads."""
    import json
    import uuid

    from pyspark.sql.types import LongType, StructField, StructType

    from onceflow.sinks.base import Decision, TaskInfo
    from onceflow.sinks.delta import DeltaDataSource

    bucket = s3.bucket()
    ds = DeltaDataSource({"path": f"s3://{bucket}/table", "storage_options": json.dumps(s3.options)})
    schema = StructType([StructField("id", LongType())])
    ds.write_schema = schema
    lineage = str(uuid.uuid4())
    ds.open(lineage)
    for batch in range(1, 11):
        rb = pa.record_batch([pa.array([batch], pa.int64())], names=["id"])
        handle, _ = ds.pre_commit(TaskInfo(lineage, batch, 0, 0), schema, False, iter([rb]))
        ds.decide(Decision(lineage, batch, f"fp-{batch}", [handle], ds.epoch), schema, False)

    def entry_reads(since: int) -> list[str]:
        return [r[1].rsplit("/", 1)[1] for r in s3.requests[since:] if r[0] == "GET" and r[4].startswith("2")
                and f"/{bucket}/table/_delta_log/0" in r[1] and r[1].endswith(".json")]

    assert ds.is_decided(lineage, 10)
    before = len(s3.requests)
    assert all(ds.is_decided(lineage, b) for b in range(1, 11))
    assert not ds.is_decided(lineage, 11)
    assert entry_reads(before) == []
    before = len(s3.requests)
    rb = pa.record_batch([pa.array([11], pa.int64())], names=["id"])
    handle, _ = ds.pre_commit(TaskInfo(lineage, 11, 0, 0), schema, False, iter([rb]))
    ds.decide(Decision(lineage, 11, "fp-11", [handle], ds.epoch), schema, False)
    assert ds.is_decided(lineage, 11)
    # only the entry this decision wrote (delta-rs reads it after its commit and on update too)
    assert set(entry_reads(before)) == {f"{11:020d}.json"}, entry_reads(before)
