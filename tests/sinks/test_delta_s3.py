"""The Delta sink on S3 (moto's server) with another delta-rs writer on the same table.

Without the object-store changes these fail at the first table access: neither
``DeltaSink(storage_options=...)`` nor ``Job(storage_options=...)`` existed, and no
``DeltaTable()``/``url_to_fs()`` call took options, so delta-rs and s3fs went to AWS instead of
the test server; ``s3a://`` table URLs were not understood by fsspec either.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid

import pyarrow as pa
import pyarrow.parquet as pq  # noqa: F401 - the sink writes Parquet
import pytest
from deltalake import DeltaTable, write_deltalake
from pyspark.sql.types import LongType, StructField, StructType

from onceflow import storage
from onceflow.job import CheckpointConfig, Job
from onceflow.runtime.restart import fixed_delay
from onceflow.sinks.base import Decision, TaskInfo
from onceflow.sinks.delta import DeltaDataSource, DeltaSink


def _table(url: str, options: dict) -> DeltaTable:
    target, delta_opts = storage.delta_target(url, options)
    return DeltaTable(target, storage_options=delta_opts)


def _other_writer_append(url: str, options: dict, ids: list[int]) -> None:
    target, delta_opts = storage.delta_target(url, options)
    write_deltalake(target, pa.table({"id": pa.array(ids, pa.int64())}), mode="append",
                    storage_options=delta_opts)


def _other_writer_command(url: str, options: dict, ids: list[int]) -> list[str]:
    """The same, as a command for the server to run."""
    code = ("import json, sys, pyarrow as pa; from deltalake import write_deltalake; "
            "from onceflow.storage import delta_target; a = json.loads(sys.argv[1]); "
            "t, o = delta_target(a['url'], a['options']); "
            "write_deltalake(t, pa.table({'id': pa.array(a['ids'], pa.int64())}), mode='append', storage_options=o)")
    return [sys.executable, "-c", code, json.dumps({"url": url, "options": options, "ids": ids})]


def _batch(ds: DeltaDataSource, lineage: str, batch: int, ids: list[int]) -> Decision:
    schema = StructType([StructField("id", LongType())])
    rb = pa.record_batch([pa.array(ids, pa.int64())], names=["id"])
    handle, rows = ds.pre_commit(TaskInfo(lineage, batch, 0, 0), schema, False, iter([rb]))
    assert rows == len(ids)
    return Decision(lineage, batch, f"fp-{batch}", [handle], ds.epoch)


def _opened_with_one_batch(s3) -> tuple[DeltaDataSource, str, str, StructType]:
    """A new S3 table opened for a new lineage, batch 1 (ids 1, 2) decided and committed:
    (source, url, lineage, schema)."""
    url = f"s3://{s3.bucket()}/table"
    ds = DeltaDataSource({"path": url, "storage_options": json.dumps(s3.options)})
    schema = StructType([StructField("id", LongType())])
    ds.write_schema = schema
    lineage = str(uuid.uuid4())
    ds.open(lineage)
    first = _batch(ds, lineage, 1, [1, 2])
    ds.decide(first, schema, False)
    ds.commit(first)
    return ds, url, lineage, schema


def test_a_concurrent_writer_committing_first_during_a_decision_and_between_batches(s3):
    url = f"s3://{s3.bucket()}/table"
    opts = s3.options
    ds = DeltaDataSource({"path": url, "storage_options": json.dumps(opts)})
    schema = StructType([StructField("id", LongType())])
    ds.write_schema = schema
    lineage = str(uuid.uuid4())
    ds.open(lineage)
    first = _batch(ds, lineage, 1, [1, 2, 3])

    # when onceflow's conditional PUT of the next log version arrives, another delta-rs writer
    # (another process) commits that very version first
    s3.rule(kind="before", method="PUT", contains="/table/_delta_log/0", if_none_match="*",
            command=_other_writer_command(url, opts, [-1, -2]))
    ds.decide(first, schema, False)
    assert s3.rules[0].get("fired")
    log_puts = [r for r in s3.requests if r[0] == "PUT" and "/table/_delta_log/0" in r[1]]
    assert "412" in [r[4] for r in log_puts]  # onceflow lost that version to the other writer...
    table = _table(url, opts)
    assert table.transaction_version(ds.app_id(lineage)) == 1  # ...and committed on top of it
    assert sorted(table.to_pyarrow_table()["id"].to_pylist()) == [-2, -1, 1, 2, 3]

    _other_writer_append(url, opts, [-3])  # between batches
    second = _batch(ds, lineage, 2, [4, 5])
    ds.decide(second, schema, False)
    ds.commit(second)
    version = _table(url, opts).version()
    ds.decide(second, schema, False)  # a replay of the decided batch writes nothing
    assert _table(url, opts).version() == version
    found = ds.decision(lineage, 2)
    assert found is not None and found.fingerprint == "fp-2"
    assert ds.recover(lineage) == {"orphans_removed": 0}
    ids = _table(url, opts).to_pyarrow_table()["id"].to_pylist()
    assert sorted(ids) == [-3, -2, -1, 1, 2, 3, 4, 5]  # each once, the other writer's rows kept


def test_a_decision_on_s3_asks_for_the_next_log_entry_with_one_head_and_lists_nothing(s3, monkeypatch):
    """The decision lookup asks whether the next log entry exists: one HEAD (404). s3fs's
    ``exists`` followed each 404 with a listing of the entry as a directory (old code: two LISTs
    of ``.../N.json/``). The decision itself does not ask again (its conditional PUT is that
    check) and takes the new entry's ETag from the PUT's answer. The entry held is checked to
    be the same (a HEAD) only when the last check or this process's append of it is
    ``RECHECK_S`` old: one HEAD and the PUT per batch of a stream. Stop 42's code: HEADs of the
    next entry 404, 404, 200 and two of the entry held, whatever their age."""
    from onceflow.sinks.delta import log as delta_log

    ds, url, lineage, schema = _opened_with_one_batch(s3)

    def decide(batch: int, ids: list[int]) -> list[list]:
        decision = _batch(ds, lineage, batch, ids)
        seen = len(s3.requests)
        assert ds.decision(lineage, batch) is None
        ds.decide(decision, schema, False)
        ds.commit(decision)
        return [r for r in s3.requests[seen:] if "_delta_log" in r[1] or "_delta_log" in r[5]]

    def heads(log: list[list], version: int) -> list[str]:
        return [r[4] for r in log if r[0] == "HEAD" and r[1].endswith(f"{version:020d}.json")]

    monkeypatch.setattr(delta_log, "RECHECK_S", 3600.0)  # the next batch comes right after
    log = decide(2, [3])
    assert not [r for r in log if r[0] == "GET" and ".json%2F" in r[5]], log  # no entry listed as a directory
    assert heads(log, 2) == ["404"] and heads(log, 1) == [], log
    assert [r[4] for r in log if r[0] == "PUT"] == ["200"], log
    monkeypatch.setattr(delta_log, "RECHECK_S", 0.0)  # every look checks the entry held
    log = decide(3, [4])
    assert heads(log, 3) == ["404"] and heads(log, 2) == ["200", "200"], log
    assert sorted(_table(url, s3.options).to_pyarrow_table()["id"].to_pylist()) == [1, 2, 3, 4]


def test_a_task_on_s3_reads_new_log_entries_forward_and_skips_a_batch_only_on_a_verified_view(s3, monkeypatch):
    """A task brings the log state its process saw forward by reading each new entry once (a
    GET, and one 404 for the entry not written yet) instead of a delta-rs refresh (stop 42's
    code: a HEAD, a LIST of ``_delta_log``, two GETs of the new entry, a HEAD and a GET of it
    again). That view is advisory: when the table was deleted and created again, the task still
    writes the batch its stale view called decided."""
    from onceflow.sinks.delta import log as delta_log

    monkeypatch.setattr(delta_log, "TASK_REUSE_S", 0.0)  # every task reads forward (see the next test)
    ds, url, lineage, schema = _opened_with_one_batch(s3)
    task = DeltaDataSource({**ds.opts, "epoch": str(ds.epoch)})
    assert not task.is_decided(lineage, 2)  # the process's state is read once
    _other_writer_append(url, s3.options, [-1])  # another process commits the next version

    seen = len(s3.requests)
    assert not task.is_decided(lineage, 2)
    second = _batch(task, lineage, 2, [3])
    log = [(r[0], r[1].rsplit("/", 1)[-1], r[4]) for r in s3.requests[seen:]
           if "_delta_log" in r[1] or "_delta_log" in r[5]]
    version = _table(url, s3.options).version()
    assert log == [("GET", f"{version:020d}.json", "200"), ("GET", f"{version + 1:020d}.json", "404")], log
    ds.decide(second, schema, False)
    ds.commit(second)
    assert task.is_decided(lineage, 2)  # confirmed on the table loaded afresh

    # the table deleted and created again: the task's forward view still says "decided"
    fs, root = storage.url_to_fs(url, s3.options)
    fs.rm(root, recursive=True)
    _other_writer_append(url, s3.options, [-5])
    assert not task.is_decided(lineage, 2)
    assert _batch(task, lineage, 2, [7]).handles[0]["rows"] == 1


def _log_requests(s3, since: int) -> list[tuple[str, str, str]]:
    return [(r[0], r[1].rsplit("/", 1)[-1] or r[5], r[4]) for r in s3.requests[since:]
            if "_delta_log" in r[1] or "_delta_log" in r[5]]


def test_a_task_on_s3_takes_a_state_read_within_task_reuse_s_as_it_is(s3, monkeypatch):
    """Within ``TASK_REUSE_S`` of reading the log, a task's process takes that state as it is:
    no request (before: two GETs per task and batch, about 10% of a 1M-row batch's time on
    moto). The state may miss the last decision: the task then writes a decided batch again
    (not skipped), and the commit keeps the decided files."""
    from onceflow.sinks.delta import log as delta_log

    ds, url, lineage, schema = _opened_with_one_batch(s3)
    driver_logs, task_logs = delta_log._LOGS, {}  # two processes: each holds its own log state

    def in_task(call):
        monkeypatch.setattr(delta_log, "_LOGS", task_logs)
        try:
            return call()
        finally:
            monkeypatch.setattr(delta_log, "_LOGS", driver_logs)

    task = DeltaDataSource({**ds.opts, "epoch": str(ds.epoch)})
    monkeypatch.setattr(delta_log, "TASK_REUSE_S", 3600.0)
    assert not in_task(lambda: task.is_decided(lineage, 2))
    second = in_task(lambda: _batch(task, lineage, 2, [3]))
    ds.decide(second, schema, False)
    ds.commit(second)
    seen = len(s3.requests)
    assert not in_task(lambda: task.is_decided(lineage, 3))  # the state read for batch 2, as it is
    assert not in_task(lambda: task.is_decided(lineage, 2))  # misses batch 2's decision: not skipped
    assert _log_requests(s3, seen) == []
    again = in_task(lambda: _batch(task, lineage, 2, [3]))  # a replay's task writes it again
    existing = ds.decision(lineage, 2)
    paths = [h["path"] for h in existing.handles]
    assert paths == [h["path"] for h in second.handles] and again.handles[0]["path"] not in paths
    ds.commit(existing)
    ds.abort(lineage, 2, again.handles)  # what the replay's commit does with a stray file
    monkeypatch.setattr(delta_log, "TASK_REUSE_S", 0.0)
    assert in_task(lambda: task.is_decided(lineage, 2))  # read forward, confirmed on the table loaded afresh
    assert sorted(_table(url, s3.options).to_pyarrow_table()["id"].to_pylist()) == [1, 2, 3]


def test_a_fresh_task_process_on_s3_reads_forward_from_the_drivers_log_seed(s3, monkeypatch):
    """After ``open()`` the driver hands its query's tasks the log state it holds
    (``task_options``: ``log_seed``); a Python worker that holds nothing reads the log forward
    from it (a GET per new entry, a 404 for the next) instead of loading the table through
    delta-rs (a LIST of ``_delta_log`` and its reads: about half a second per worker in a
    stream's first batch on moto). Old code: no seed (``task_options`` did not exist)."""
    from onceflow.sinks.delta import access as delta_access
    from onceflow.sinks.delta import log as delta_log

    ds, url, lineage, schema = _opened_with_one_batch(s3)
    opts = ds.task_options(lineage)
    assert set(opts) == {"log_seed"}
    _other_writer_append(url, s3.options, [-1])  # a version the seed does not hold
    monkeypatch.setattr(delta_log, "_LOGS", {})  # a fresh Python worker: no log, no table held
    monkeypatch.setattr(delta_access, "_TABLES", {})
    monkeypatch.setattr(delta_log, "TASK_REUSE_S", 0.0)
    task = DeltaDataSource({**ds.opts, "epoch": str(ds.epoch), **opts})
    version = _table(url, s3.options).version()
    seen = len(s3.requests)
    assert not task.is_decided(lineage, 2)
    assert _log_requests(s3, seen) == [("GET", f"{version:020d}.json", "200"),
                                       ("GET", f"{version + 1:020d}.json", "404")]
    second = _batch(task, lineage, 2, [3])
    ds.decide(second, schema, False)
    ds.commit(second)
    assert sorted(_table(url, s3.options).to_pyarrow_table()["id"].to_pylist()) == [-1, 1, 2, 3]
    # a seed older than FORWARD_MAX_AGE_S, or one that cannot be read, is ignored: the table is loaded
    monkeypatch.setattr(delta_log, "_LOGS", {})
    monkeypatch.setattr(delta_log, "FORWARD_MAX_AGE_S", 0.0)
    stale = DeltaDataSource({**ds.opts, "epoch": str(ds.epoch), **opts})
    assert stale.is_decided(lineage, 2)
    monkeypatch.setattr(delta_log, "_LOGS", {})
    broken = DeltaDataSource({**ds.opts, "epoch": str(ds.epoch), "log_seed": "{not json"})
    assert broken.is_decided(lineage, 2)


def test_spark_job_to_delta_on_s3a_exactly_once_beside_a_concurrent_writer(spark, s3_server, tmp_path, monkeypatch):
    """A real query; the storage options come only from ``Job(storage_options=...)`` (no
    environment variable), so they must travel with the sink's options to the executors."""
    monkeypatch.delenv("ONCEFLOW_STORAGE_OPTIONS", raising=False)
    s3_server.clear()
    url = f"s3a://{s3_server.bucket()}/orders"  # what Spark users write
    opts = s3_server.options
    total = 2000

    def source(sp):
        return (sp.readStream.format("onceflow-sequence").option("total", total)
                .option("rows_per_second", 10_000_000).option("max_rows_per_batch", 1000).load())

    job = Job(name="s3e2e", source=source, sink=DeltaSink(url),
              checkpoint=CheckpointConfig(str(tmp_path / "ckpt"), interval=0),
              restart_strategy=fixed_delay(attempts=2, delay=0), stop_when_idle=1.0,
              storage_options=opts)
    assert "testing" not in repr(job) and "testing" not in repr(job.storage_options)
    done, appended = threading.Event(), []

    def concurrent_writer():
        target, delta_opts = storage.delta_target(url, opts)
        while not done.is_set():
            try:
                schema = DeltaTable(target, storage_options=delta_opts).schema().to_arrow()
            except Exception:  # noqa: BLE001 - the sink has not created the table yet
                time.sleep(0.1)
                continue
            k = len(appended) + 1
            write_deltalake(target, pa.table({"id": [-k], "key": [-1], "event_time": [None]},
                                             schema=pa.schema(schema)), mode="append",
                            storage_options=delta_opts)
            appended.append(-k)
            time.sleep(0.5)

    writer = threading.Thread(target=concurrent_writer, daemon=True)
    writer.start()
    try:
        job.run(spark=spark)
    finally:
        done.set()
        writer.join(30)
        storage.configure(None)
    ids = _table(url, opts).to_pyarrow_table()["id"].to_pylist()
    mine = sorted(i for i in ids if i >= 0)
    assert mine == list(range(total))  # every id exactly once
    assert appended and sorted(i for i in ids if i < 0) == sorted(appended)  # the other writer's rows stay
    assert not any(r[3] for r in s3_server.requests if "/orders/" in r[1])  # never a copy (rename)


@pytest.mark.parametrize("bad", ['{"endpoint_url": ', '["not", "a", "mapping"]'])
def test_bad_storage_options_are_one_clear_line(bad):
    from onceflow.errors import ConfigError

    with pytest.raises(ConfigError, match="storage_options"):
        DeltaDataSource({"path": "s3://b/t", "storage_options": bad})


def test_the_decision_writes_its_own_log_entry_unless_delta_rs_is_told_how_to_commit(s3):
    """On S3 the decision appends the next log entry itself (StoreLog's conditional create);
    a table whose options choose another way for delta-rs to commit (a DynamoDB locking
    provider: a store that ignores If-None-Match) leaves every commit to delta-rs."""
    from onceflow.sinks.delta.log import StoreLog

    url = f"s3://{s3.bucket()}/table"
    own = DeltaDataSource({"path": url, "storage_options": json.dumps(s3.options)})
    assert isinstance(own._commit_log(), StoreLog)
    locked = DeltaDataSource({"path": url, "storage_options": json.dumps(
        {**s3.options, "AWS_S3_LOCKING_PROVIDER": "dynamodb", "DELTA_DYNAMO_TABLE_NAME": "delta_log"})})
    assert locked._commit_log() is None
