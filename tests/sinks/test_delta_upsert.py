"""Delta sink, ``write="upsert"``: MERGE with deletes, exactly-once (real Spark, real tables).

The expected table is computed here from the event stream alone; the table is read back by
delta-rs (``DeltaTable.to_pyarrow_table``) and by a pyarrow dataset over the data files the
log lists, not by the sink's code. Crash windows and zombies run in test_conformance.py
(``delta-upsert``)."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.dataset as ds
import pytest
from deltalake import DeltaTable, write_deltalake

from onceflow.checkpoint.eventlog import EventLog
from onceflow.errors import ConfigError
from onceflow.job import CheckpointConfig, Job
from onceflow.runtime.restart import fixed_delay
from onceflow.sinks.delta import DeltaSink
from onceflow.verify.readers import delta_dangling

KEYS = 97
#: CDC events: key k = id % 97, seq = id; every 7th event (id % 7 == 3) deletes its key, the rest
#: set v to the event's id. ``seq`` descends within each batch of 1000 ids (rev): only
#: order_by makes the newest event win, the batch's own order would pick the oldest.
EVENTS = ("id % 97 AS k", "(CAST(id / 1000 AS BIGINT) * 1000 + 999 - id % 1000) AS seq",
          "CASE WHEN id % 7 = 3 THEN 'd' ELSE 'u' END AS op", "CONCAT('v', id) AS v")


def expected(total: int) -> dict[int, dict]:
    """The table after every event up to ``total``, applied in ``seq`` order."""
    out: dict[int, dict] = {}
    events = sorted(((i // 1000) * 1000 + 999 - i % 1000, i) for i in range(total))
    for seq, i in events:
        if i % 7 == 3:
            out.pop(i % KEYS, None)
        else:
            out[i % KEYS] = {"k": i % KEYS, "seq": seq, "op": "u", "v": f"v{i}"}
    return out


def job(tmp_path, sink: DeltaSink, total: int = 5000, select=EVENTS, per_batch: int = 1000,
        ckpt: str = "ckpt") -> Job:
    def source(spark):
        return (spark.readStream.format("onceflow-sequence").option("total", total)
                .option("rows_per_second", 10**9).option("max_rows_per_batch", per_batch).load())

    return Job(name="u", source=source, transform=lambda df: df.selectExpr(*select), sink=sink,
               checkpoint=CheckpointConfig(str(tmp_path / ckpt), interval=0),
               restart_strategy=fixed_delay(attempts=3, delay=0), stop_when_idle=1.0)


def read_rows(table) -> dict[int, dict]:
    """Through delta-rs, and the same through a pyarrow dataset over the files the log lists."""
    t = DeltaTable(str(table))
    rows = t.to_pyarrow_table().to_pylist()
    by_key = {r["k"]: r for r in rows}
    assert len(by_key) == len(rows), "a key twice"
    files = [f.removeprefix("file://") for f in t.file_uris()]
    raw = ds.dataset(files, format="parquet").to_table(columns=["k"]).column("k").to_pylist() if files else []
    assert sorted(raw) == sorted(by_key)
    return by_key


def sink(table, **kw) -> DeltaSink:
    return DeltaSink(str(table), write="upsert", keys=["k"], delete_when="op = 'd'", order_by="seq", **kw)


def test_the_last_event_per_key_wins_deletes_delete_and_nothing_else_is_written(spark, tmp_path):
    table = tmp_path / "table"
    job(tmp_path, sink(table)).run(spark=spark)
    got = read_rows(table)
    assert got == expected(5000)
    assert set(DeltaTable(str(table)).schema().to_arrow().names) == {"k", "seq", "op", "v"}
    assert delta_dangling(str(table)) == []
    assert not [n for n in os.listdir(table) if n.startswith("part-of-")], "staged files left"


def test_a_batch_replayed_after_its_merge_changes_nothing(spark, tmp_path):
    """The MERGE of batch 2 lands and its commit then raises as if the reply were lost; the
    restarted query finds the batch decided and merges nothing (a second MERGE would re-apply
    batch 2's events over batch 3's: an old value comes back)."""
    table, markers = tmp_path / "table", tmp_path / "markers"
    markers.mkdir()
    s = sink(table)
    opts = s.options() | {"test_crash_at": "after_decide@2:raise", "test_crash_markers": str(markers)}
    s.options = lambda: opts  # type: ignore[method-assign]
    job(tmp_path, s).run(spark=spark)
    assert os.listdir(markers), "the fault after the decision never fired"
    assert read_rows(table) == expected(5000)
    merges = [h for h in DeltaTable(str(table)).history() if h.get("operation") == "MERGE"]
    assert len(merges) == 5, f"{len(merges)} MERGE commits for 5 batches"


def test_partitioned_upsert_into_an_existing_table_keeps_its_partitioning(spark, tmp_path):
    table = tmp_path / "table"
    write_deltalake(str(table), pa.table({"k": pa.array([1, 500], pa.int64()), "seq": pa.array([-1, -1], pa.int64()),
                                          "op": ["u", "u"], "v": ["old", "keep"], "p": pa.array([1, 0], pa.int64())}),
                    partition_by=["p"])
    select = (*EVENTS, "(id % 97) % 2 AS p")
    job(tmp_path, sink(table), total=3000, select=select).run(spark=spark)
    t = DeltaTable(str(table))
    assert t.metadata().partition_columns == ["p"]
    got = read_rows(table)
    want = {k: r | {"p": k % 2} for k, r in expected(3000).items()} | {500: {"k": 500, "seq": -1, "op": "u",
                                                                           "v": "keep", "p": 0}}
    assert got == want


@pytest.mark.parametrize("kw, message", [
    ({"write": "upsert"}, "needs keys"),
    ({"write": "upsert", "keys": ["k"], "writer": "jvm"}, "arrow writer"),
    ({"keys": ["k"]}, "write='upsert' only"),
    ({"write": "merge"}, "use 'append' or 'upsert'"),
])
def test_bad_upsert_options_are_refused_in_one_line(tmp_path, kw, message):
    with pytest.raises(ConfigError, match=message):
        DeltaSink(str(tmp_path / "t"), **kw)


@pytest.mark.parametrize("kw, message", [
    ({"keys": ["nope"]}, "keys names nope, not a column"),
    ({"keys": ["k"], "delete_when": "no_such_col = 1"}, "not a SQL predicate over the stream's columns"),
    ({"keys": ["k"], "order_by": "missing"}, "order_by names missing"),
])
def test_bad_columns_and_predicates_stop_the_job_before_any_batch(spark, tmp_path, kw, message):
    table = tmp_path / "table"
    with pytest.raises(ConfigError, match=message):
        job(tmp_path, DeltaSink(str(table), write="upsert", **kw), total=10).run(spark=spark)
    assert not (table / "_delta_log").exists()


def test_upsert_refuses_complete_mode(spark, tmp_path):
    table = tmp_path / "table"
    j = job(tmp_path, sink(table), total=10)
    j.output_mode = "complete"
    with pytest.raises(ConfigError, match="complete mode replaces it"):
        j.run(spark=spark)
    assert not EventLog(str(tmp_path / "ckpt")).read() or not (table / "_delta_log").exists()


def test_two_jobs_upserting_one_table_at_once_each_merge_every_batch_once(tmp_path):
    """Two lineages (two jobs) decide 15 batches each into one table from two threads at the
    same time, through the data source's own protocol: MERGEs that lose the race to the other
    job's commit are read again and retried on top; every batch lands once, no key is lost.
    (Counted with the decide loop's debug log: 19 and 24 lost races in two runs of 30 MERGEs.)"""
    import json
    import threading

    from pyspark.sql.types import BooleanType, LongType, StructField, StructType

    from onceflow.sinks.base import PreCommitted, TaskInfo, TwoPhaseCommitWriter

    table = str(tmp_path / "table")
    schema = StructType([StructField("k", LongType()), StructField("seq", LongType()),
                         StructField("_onceflow_delete", BooleanType())])
    sink = DeltaSink(table, write="upsert", keys=["k"], order_by="seq", delete_when="unused")
    errors: list[BaseException] = []

    def job(n: int) -> None:
        try:
            ds = sink.data_source({"allow_unknown_fingerprint": "true", "sink_id": "shared"})
            ds.write_schema = schema
            ds.validate(schema, False)
            lineage = f"job{n}"
            ds.opts["lineage"] = lineage
            ds.open(lineage)
            for b in range(15):
                keys = pa.array([n * 1000 + b % 5 * 10 + i for i in range(10)], pa.int64())
                rows = pa.table({"k": keys, "seq": pa.array([b] * 10, pa.int64()),
                                 "_onceflow_delete": pa.array([False] * 10)})
                handle, count = ds.pre_commit(TaskInfo(lineage, b, 0, 0), schema, False, iter(rows.to_batches()))
                TwoPhaseCommitWriter(ds, schema, False).commit([PreCommitted(lineage, b, 0, 0, count, handle)], b)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=job, args=(n,)) for n in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    got = {r["k"]: r["seq"] for r in DeltaTable(table).to_pyarrow_table().to_pylist()}
    want = {n * 1000 + j * 10 + i: 10 + j for n in (1, 2) for j in range(5) for i in range(10)}
    assert got == want
    merges: dict = {}
    for h in DeltaTable(table).history():
        if h.get("operation") == "MERGE":
            meta = json.loads(h["onceflow"])
            merges[(meta["lineage"], meta["batch"])] = merges.get((meta["lineage"], meta["batch"]), 0) + 1
    assert sorted(merges) == sorted((f"job{n}", b) for n in (1, 2) for b in range(15))
    assert set(merges.values()) == {1}
