"""The Delta sink's constant-cost log (sinks/delta/log.py): what it writes is a Delta table
delta-rs reads, and it never commits on top of a log that moved (no Spark needed)."""

from __future__ import annotations

import json
import os
import shutil
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake
from pyspark.sql.types import LongType, StructField, StructType

from onceflow.errors import FencedError
from onceflow.sinks.base import Decision
from onceflow.sinks.delta import DeltaDataSource
from onceflow.sinks.delta.log import local_log

SCHEMA = StructType([StructField("id", LongType())])


def opened(path, **opts) -> tuple[DeltaDataSource, str, int]:
    lineage = str(uuid.uuid4())
    ds = DeltaDataSource({"path": str(path), **opts})
    ds.write_schema = SCHEMA
    return ds, lineage, ds.open(lineage)


def batch_file(path, lineage: str, epoch: int, batch: int, ids: list[int]) -> dict:
    name = f"part-of-{lineage}-e{epoch}-b{batch:010d}-p00000-a0-{uuid.uuid4().hex[:12]}.parquet"
    pq.write_table(pa.table({"id": pa.array(ids, pa.int64())}), path / name)
    return {"path": name, "size": (path / name).stat().st_size, "rows": len(ids), "mtime": 0}


def decide(ds, lineage, epoch, batch, handles) -> None:
    ds.decide(Decision(lineage, batch, f"fp-{batch}", handles, epoch), SCHEMA, False)


def test_appended_versions_are_a_delta_table_with_checkpoints(tmp_path):
    """Batches decided through the local log: delta-rs reads the rows, the app transaction and
    onceflow's commit info, and a checkpoint is written every delta.checkpointInterval."""
    path = tmp_path / "table"
    write_deltalake(str(path), pa.table({"id": pa.array([-1], pa.int64())}),
                    configuration={"delta.checkpointInterval": "4"})
    ds, lineage, epoch = opened(path)
    for b in range(9):
        decide(ds, lineage, epoch, b, [batch_file(path, lineage, epoch, b, [10 * b, 10 * b + 1])])
    engines = [json.loads(open(path / "_delta_log" / f"{v:020d}.json").readline())["commitInfo"]["engineInfo"]
               for v in range(2, 11)]
    assert all(e.startswith("onceflow/") for e in engines), engines  # the local log wrote them
    table = DeltaTable(str(path))
    assert table.version() == 10
    assert sorted(table.to_pyarrow_table().column("id").to_pylist()) == [-1] + [
        x for b in range(9) for x in (10 * b, 10 * b + 1)]
    assert table.transaction_version(ds.app_id(lineage)) == 8
    assert json.load(open(path / "_delta_log" / "_last_checkpoint"))["version"] == 8
    found = ds.decision(lineage, 5)
    assert found is not None and found.fingerprint == "fp-5" and found.epoch == epoch
    assert ds.is_decided(lineage, 8) and not ds.is_decided(lineage, 9)


def test_a_commit_that_lost_the_race_reads_the_log_again(tmp_path):
    """Another writer's version lands after the decide step last looked: the next decision is
    checked and committed on top of it (nothing of either is lost). A successor's epoch that
    lands the same way fences the decision, even though the older view was current before."""
    path = tmp_path / "table"
    ds, lineage, epoch = opened(path)
    decide(ds, lineage, epoch, 0, [batch_file(path, lineage, epoch, 0, [1])])  # the view is warm
    write_deltalake(str(path), pa.table({"id": pa.array([100], pa.int64())}), mode="append")
    decide(ds, lineage, epoch, 1, [batch_file(path, lineage, epoch, 1, [2])])
    table = DeltaTable(str(path))
    assert sorted(table.to_pyarrow_table().column("id").to_pylist()) == [1, 2, 100]
    assert table.transaction_version(ds.app_id(lineage)) == 1

    successor = DeltaDataSource({"path": str(path)})
    successor.write_schema = SCHEMA
    assert successor.open(lineage) == epoch + 1
    with pytest.raises(FencedError):
        decide(ds, lineage, epoch, 2, [batch_file(path, lineage, epoch, 2, [3])])
    assert DeltaTable(str(path)).transaction_version(ds.app_id(lineage)) == 1


def test_a_version_written_meanwhile_is_never_overwritten(tmp_path):
    """The log entry the local log wants to write exists: it reports the lost race and leaves
    the existing entry as it was (put-if-absent)."""
    path = tmp_path / "table"
    ds, lineage, epoch = opened(path)
    decide(ds, lineage, epoch, 0, [])
    local = local_log(str(path))
    apps = (ds.app_id(lineage), ds.epoch_app_id(lineage))
    snap = local.snapshot(apps)
    assert snap is not None
    write_deltalake(str(path), pa.table({"id": pa.array([7], pa.int64())}), mode="append")
    entry = path / "_delta_log" / f"{snap.version + 1:020d}.json"
    before = entry.read_bytes()
    assert local.snapshot(apps) is None  # the log moved
    assert local.append(snap, [], ds.app_id(lineage), 1, {}) is None
    assert entry.read_bytes() == before
    assert not [n for n in os.listdir(path / "_delta_log") if n.endswith(".tmp")]


def test_a_table_replaced_by_one_with_as_long_a_log_is_read_afresh(tmp_path):
    """The table is deleted and created again with exactly as many versions as the one the
    sink knew: its state must come from the new log (batch 1 undecided, epoch 1 again), not
    from the old snapshot, whose latest entry exists again and has no successor."""
    path = tmp_path / "table"
    ds, lineage, epoch = opened(path)
    for b in range(3):
        decide(ds, lineage, epoch, b, [])
    assert ds.is_decided(lineage, 1)
    shutil.rmtree(path)
    for i in range(4):  # versions 0-3, as the old table had
        write_deltalake(str(path), pa.table({"id": pa.array([i], pa.int64())}), mode="append")
    assert not ds.is_decided(lineage, 1) and ds.decision(lineage, 1) is None
    assert ds.open(lineage) == 1


def test_a_table_whose_protocol_needs_more_than_adds_commits_through_delta_rs(tmp_path):
    """A table with change data feed (writer version 4) is not appended to by hand: delta-rs
    commits, which knows the protocol."""
    path = tmp_path / "table"
    write_deltalake(str(path), pa.table({"id": pa.array([0], pa.int64())}),
                    configuration={"delta.enableChangeDataFeed": "true"})
    ds, lineage, epoch = opened(path)
    for b in range(2):
        decide(ds, lineage, epoch, b, [batch_file(path, lineage, epoch, b, [b + 1])])
    last = json.loads(open(path / "_delta_log" / f"{3:020d}.json").readline())["commitInfo"]
    assert last["engineInfo"].startswith("delta-rs")
    assert not local_log(str(path)).eligible
    assert sorted(DeltaTable(str(path)).to_pyarrow_table().column("id").to_pylist()) == [0, 1, 2]


def test_a_task_reads_new_entries_forward_for_a_minute_then_loads_the_table_again(tmp_path, monkeypatch):
    """A task's view is the state its process loaded, read forward entry by entry (another
    writer's ``metaData`` included); past ``FORWARD_MAX_AGE_S`` since that load the table is
    loaded again (a log cleaned up past the entry held would otherwise keep a stale view), and
    what was read forward from the old load is dropped. Old code: no forward reading."""
    from onceflow.sinks.delta import log as delta_log

    path = tmp_path / "table"
    ds, lineage, epoch = opened(path)
    decide(ds, lineage, epoch, 0, [])
    log = local_log(str(path))
    apps = (ds.app_id(lineage), ds.epoch_app_id(lineage))
    ahead = log.advance(apps)
    assert ahead is not None and not ahead.verified and ahead.transaction_version(apps[0]) == 0
    write_deltalake(str(path), pa.table({"id": pa.array([7], pa.int64())}), mode="append")  # another writer
    decide(ds, lineage, epoch, 1, [])
    ahead = log.advance(apps)
    assert ahead.version == DeltaTable(str(path)).version() and ahead.transaction_version(apps[0]) == 1
    monkeypatch.setattr(delta_log, "FORWARD_MAX_AGE_S", 0.0)
    assert log.advance(apps) is None  # loaded too long ago: the caller loads the table
    assert ds.is_decided(lineage, 1) and not ds.is_decided(lineage, 2)  # through a load
    assert log._ahead is None  # the load dropped what was read forward before it
