"""The Iceberg sink beyond the conformance suite: its catalog surface, its conditional commit
against other writers, a lost commit reply across processes, and a PostgreSQL catalog.

Real pyiceberg, real SQLite (and PostgreSQL) catalogs, real processes killed with SIGKILL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark.sql.types import BooleanType, LongType, StringType, StructField, StructType

from onceflow.errors import ConfigError
from onceflow.sinks.base import Decision, TaskInfo

SCHEMA = StructType([StructField("id", LongType())])
ROOT = Path(__file__).resolve().parents[2]


def _source(catalog: str, warehouse: str | None = None, table: str = "lake.t"):
    from onceflow import IcebergSink

    ds = IcebergSink(catalog, table, warehouse=warehouse).data_source()
    ds.write_schema = SCHEMA
    ds.validate(SCHEMA, False)
    return ds


def _rows(ids: list[int]) -> list[pa.RecordBatch]:
    return pa.table({"id": pa.array(ids, pa.int64())}).to_batches()


def _ids(ds) -> list[int]:
    return sorted(ds._table().scan().to_arrow().column("id").to_pylist())


@pytest.mark.parametrize("catalog, warehouse, message", [
    ("catalog.db", None, "SQLAlchemy URL"),
    ("sqlite:///:memory:", None, "every driver and executor reaches"),
    ("postgresql://u:p@localhost/db", None, "needs warehouse="),
    ("mysql://u@h/db", None, "not supported"),
])
def test_a_catalog_that_cannot_work_is_refused_with_what_to_give(catalog, warehouse, message):
    from onceflow import IcebergSink

    with pytest.raises(ConfigError, match=message):
        IcebergSink(catalog, "lake.t", warehouse=warehouse)


def test_options_and_modes_that_do_not_exist_are_refused(tmp_path):
    from onceflow import IcebergSink
    from onceflow.sinks.iceberg import IcebergDataSource

    with pytest.raises(ConfigError, match="not supported; use 'append'.*write='upsert'"):
        IcebergSink(f"sqlite:///{tmp_path}/c.db", "lake.t", mode="upsert")
    with pytest.raises(ConfigError, match="namespace.name"):
        IcebergSink(f"sqlite:///{tmp_path}/c.db", "t").data_source()
    with pytest.raises(ConfigError, match="unknown option.*nonsense"):
        IcebergDataSource({"catalog": f"sqlite:///{tmp_path}/c.db", "table": "lake.t", "nonsense": "1"})
    with pytest.raises(ConfigError, match="keys applies to write='upsert' only"):
        IcebergDataSource({"catalog": f"sqlite:///{tmp_path}/c.db", "table": "lake.t", "keys": "id"})
    with pytest.raises(ConfigError, match="compression='lzo': use one of zstd, snappy"):
        IcebergSink(f"sqlite:///{tmp_path}/c.db", "lake.t", compression="lzo")
    with pytest.raises(ConfigError, match="compression='lzo': use one of zstd, snappy"):
        IcebergDataSource({"catalog": f"sqlite:///{tmp_path}/c.db", "table": "lake.t", "compression": "lzo"})
    ds = _source(f"sqlite:///{tmp_path}/c.db")
    with pytest.raises(ConfigError, match="append only"):
        ds.validate(SCHEMA, True)


def test_the_embedded_catalog_is_one_sqlite_file_with_its_warehouse_beside_it(tmp_path):
    """``sqlite:///…/catalog.db`` alone: the table lands in ``warehouse/`` next to the file, is
    created from the stream's schema on open, and the public export and registry know the sink."""
    import onceflow
    from onceflow.sinks.registry import SINKS, _load

    assert _load(SINKS["onceflow-iceberg"]).__name__ == "IcebergDataSource"
    assert onceflow.IcebergSink.format_name == "onceflow-iceberg"
    ds = _source(f"sqlite:///{tmp_path}/cat/catalog.db")
    lineage = str(uuid.uuid4())
    epoch = ds.open(lineage)
    assert ds._table().location() == f"file://{tmp_path}/cat/warehouse/lake/t"
    handle, rows = ds.pre_commit(TaskInfo(lineage, 0, 0, 0), SCHEMA, False, iter(_rows([1, 2, 3])))
    assert rows == 3 and _ids(ds) == [], "pre-committed rows are invisible"
    ds.decide(Decision(lineage, 0, "fp", [handle], epoch), SCHEMA, False)
    assert _ids(ds) == [1, 2, 3]
    summary = ds._table().current_snapshot().summary
    assert (summary["onceflow.lineage"], summary["onceflow.batch"], summary["onceflow.epoch"]) == (
        lineage, "0", str(epoch))


def test_a_commit_based_on_stale_metadata_is_refused_not_rebased(tmp_path):
    """pyiceberg retries a commit that lost a race by rebuilding it on the new metadata; the
    sink's commit must instead fail, so that its fence and decided-batch check run again on
    what it would land on."""
    from pyiceberg.exceptions import CommitFailedException

    from onceflow.sinks.iceberg.state import LineageState, decision_properties

    ds = _source(f"sqlite:///{tmp_path}/catalog.db")
    lineage = str(uuid.uuid4())
    epoch = ds.open(lineage)
    stale = ds._table()
    ds._table().append(pa.table({"id": pa.array([100], pa.int64())}))  # another writer
    handle, _ = ds.pre_commit(TaskInfo(lineage, 0, 0, 0), SCHEMA, False, iter(_rows([1])))
    with pytest.raises(CommitFailedException):
        ds._commit(stale, lineage, LineageState(epoch, 0),
                   decision_properties("iceberg", lineage, epoch, 0, "fp", [handle["path"]]), [handle["path"]])
    assert _ids(ds) == [100] and not ds.is_decided(lineage, 0)


def test_a_commit_of_another_writer_between_check_and_commit_is_retried_on_top(tmp_path):
    """Another writer commits after decide read the metadata and before its commit: the catalog
    refuses the commit, decide checks again on the new metadata and commits on top; nothing
    dropped, nothing twice."""
    from onceflow.sinks.iceberg import IcebergDataSource

    class RacedSource(IcebergDataSource):
        races = 2  # the first two loads are followed by another writer's commit

        def _table(self):
            table = super()._table()
            if self.races and table is not None and self.opts.get("race") == "on":
                self.races -= 1
                super()._table().append(pa.table({"id": pa.array([1000 + self.races], pa.int64())}))
            return table

    base = _source(f"sqlite:///{tmp_path}/catalog.db")
    ds = RacedSource(base.opts)
    ds.write_schema = SCHEMA
    lineage = str(uuid.uuid4())
    epoch = ds.open(lineage)
    handle, _ = ds.pre_commit(TaskInfo(lineage, 0, 0, 0), SCHEMA, False, iter(_rows([1, 2])))
    ds.opts["race"] = "on"
    ds.decide(Decision(lineage, 0, "fp", [handle], epoch), SCHEMA, False)
    assert ds.races == 0, "both races happened"
    assert _ids(ds) == [1, 2, 1000, 1001]
    ds.decide(Decision(lineage, 0, "fp", [handle], epoch), SCHEMA, False)  # a retry: nothing
    assert _ids(ds) == [1, 2, 1000, 1001]


@pytest.mark.parametrize("write", ["append", "upsert"])
def test_lost_commit_replies_across_processes_leave_no_duplicate(tmp_path, write):
    """A few trials of benchmarks/iceberg_lost_reply.py (its 100-trial runs are in the docs): a
    process SIGKILLed right after the catalog took its snapshot, a new process replays the
    batch and finds it decided; the independent count has no duplicate, gap, orphan file or
    batch applied twice, and (upsert, new here: ``--write`` did not exist) every key holds the
    value of its last event, deleted keys absent."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "iceberg_lost_reply.py"),
                          "--trials", "2", "--rows", "200", "--dir", str(tmp_path), "--write", write],
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["writers_killed"] == 2 and report["replays_that_found_their_batch_decided"] == 2
    assert (report["duplicates"], report["missing"], report["dangling_files"], report["applied_twice"]) == (0, 0, 0, 0)
    if write == "upsert":
        assert (report["wrong"], report["resurrected"], report["deleted_keys"], report["rows"]) == (0, 0, 20, 380)
    else:
        assert report["rows"] == 400


def test_recovery_removes_files_of_undecided_batches_only(tmp_path):
    """A driver pre-committed batch 1 and died; the next one's recovery deletes that file and
    keeps batch 0's (decided) and a file of its own epoch (in flight)."""
    ds = _source(f"sqlite:///{tmp_path}/catalog.db")
    lineage = str(uuid.uuid4())
    e1 = ds.open(lineage)
    h0, _ = ds.pre_commit(TaskInfo(lineage, 0, 0, 0), SCHEMA, False, iter(_rows([1])))
    ds.decide(Decision(lineage, 0, "fp", [h0], e1), SCHEMA, False)
    lost, _ = ds.pre_commit(TaskInfo(lineage, 1, 0, 0), SCHEMA, False, iter(_rows([2])))
    successor = _source(f"sqlite:///{tmp_path}/catalog.db")
    fs, data = successor._data_dir()
    successor.opts["epoch"] = str(successor.acquire_epoch(lineage))
    mine, _ = successor.pre_commit(TaskInfo(lineage, 1, 0, 1), SCHEMA, False, iter(_rows([2])))
    assert successor.recover(lineage) == {"orphans_removed": 1}
    assert sorted(os.listdir(data)) == sorted([h0["path"], mine["path"]])
    assert lost["path"] not in os.listdir(data)


def test_a_postgresql_catalog_decides_and_fences_the_same_way(pg, tmp_path):
    """The same sink on a SQL catalog in the project's real PostgreSQL (psycopg 3)."""
    import psycopg

    from onceflow.errors import FencedError

    db = f"ice_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {db}")
    url = pg.dsn.rsplit("/", 1)[0] + f"/{db}"
    a = _source(url.replace("postgresql://", "postgresql+psycopg://", 1), warehouse=str(tmp_path / "wh"))
    b = _source(url, warehouse=str(tmp_path / "wh"))
    lineage = str(uuid.uuid4())
    ea = a.open(lineage)
    handle, _ = a.pre_commit(TaskInfo(lineage, 0, 0, 0), SCHEMA, False, iter(_rows([7, 8])))
    eb = b.open(lineage)  # its recovery deletes a's file: an orphan of an older epoch
    with pytest.raises(FencedError, match="opened the sink since"):
        a.decide(Decision(lineage, 0, "fp", [handle], ea), SCHEMA, False)
    mine, _ = b.pre_commit(TaskInfo(lineage, 0, 0, 1), SCHEMA, False, iter(_rows([7, 8])))
    b.decide(Decision(lineage, 0, "fp", [mine], eb), SCHEMA, False)
    assert _ids(b) == [7, 8] and b.decision(lineage, 0).epoch == eb


def test_a_plain_writestream_creates_the_table_and_writes_each_row_once(spark, tmp_path):
    """``writeStream.format("onceflow-iceberg")`` without a Job: the table is created when the
    query starts (tasks need its location before any commit); a second run of the same
    checkpoint adds only new rows, written with the codec it names (zstd by default)."""
    import pyarrow.parquet as pq
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.exceptions import NoSuchTableError

    from onceflow.spark import register_all

    register_all(spark)
    catalog = f"sqlite:///{tmp_path}/catalog.db"

    def ids() -> list[int]:
        try:
            table = SqlCatalog("onceflow", uri=catalog).load_table("lake.plain")
        except NoSuchTableError:
            return []
        return sorted(table.scan().to_arrow().column("id").to_pylist())

    def run(total: int, **options: str) -> None:
        df = (spark.readStream.format("onceflow-sequence").option("total", total)
              .option("rows_per_second", 10**9).option("max_rows_per_batch", 500).option("partitions", 2)
              .load().select("id"))
        q = (df.writeStream.format("onceflow-iceberg").option("catalog", catalog).option("table", "lake.plain")
             .options(**options)
             .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(processingTime="100 milliseconds")
             .start())
        deadline = time.monotonic() + 240
        while len(ids()) < total and q.exception() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        q.stop()
        assert q.exception() is None

    def codecs() -> set[str]:
        files = SqlCatalog("onceflow", uri=catalog).load_table("lake.plain").inspect.files().column("file_path")
        return {pq.ParquetFile(f.as_py().removeprefix("file://")).metadata.row_group(0).column(0).compression
                for f in files}

    run(1000)
    assert codecs() == {"ZSTD"}
    run(1500, compression="snappy")
    assert ids() == list(range(1500))
    assert codecs() == {"ZSTD", "SNAPPY"}


def test_without_pyiceberg_the_sink_says_which_extra_to_install_and_the_others_still_register():
    """Before: ``from onceflow import IcebergSink`` without the extra was a bare
    ``ModuleNotFoundError: No module named 'pyiceberg'``."""
    code = ("import sys; sys.modules['pyiceberg'] = None\n"
            "from onceflow.sinks.registry import data_sources\n"
            "print(sorted(c.__name__ for c in data_sources()))\n"
            "from onceflow import IcebergSink\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "'DeltaDataSource'" in r.stdout and "Iceberg" not in r.stdout, r.stdout
    assert r.returncode == 1 and "pip install 'onceflow[iceberg]'" in r.stderr.splitlines()[-1], r.stderr


# ---- upsert ------------------------------------------------------------------------------------
# Before this branch: IcebergSink had no ``write``/``keys`` arguments (TypeError) and the data
# source refused the options (ConfigError "unknown option(s) keys, write"), so each test below
# fails on the old code at its first line; the semantics they check did not exist.

USCHEMA = StructType([StructField("id", LongType()), StructField("v", StringType()),
                      StructField("ts", LongType()), StructField("_onceflow_delete", BooleanType())])


def _upsert_source(tmp_path, order_by: str | None = "ts", cls=None):
    from onceflow import IcebergSink

    sink = IcebergSink(f"sqlite:///{tmp_path}/catalog.db", "lake.u", write="upsert", keys=["id"],
                       order_by=order_by, delete_when="v = 'del'")
    opts = sink.options()
    ds = (cls or type(sink.data_source()))(opts)
    ds.write_schema = USCHEMA
    ds.validate(USCHEMA, False)
    return ds


def _events(rows: list[tuple]) -> Iterator:
    """(id, v, ts) events; v == 'del' sets the delete flag (what delete_when computes)."""
    ids, vs, ts = (list(c) for c in zip(*rows, strict=True)) if rows else ([], [], [])
    return iter(pa.table({"id": pa.array(ids, pa.int64()), "v": pa.array(vs, pa.string()),
                          "ts": pa.array(ts, pa.int64()),
                          "_onceflow_delete": pa.array([v == "del" for v in vs])}).to_batches(max_chunksize=2))


def _state(ds) -> dict[int, tuple]:
    rows = ds._table().scan().to_arrow().to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), f"a key twice: {sorted(ids)}"
    return {r["id"]: (r["v"], r["ts"]) for r in rows}


def _apply(ds, lineage: str, epoch: int, batch: int, tasks: list[list[tuple]], fp: str = "fp") -> Decision:
    handles = []
    for part, rows in enumerate(tasks):
        handle, _ = ds.pre_commit(TaskInfo(lineage, batch, part, 0), USCHEMA, False, _events(rows))
        if handle:
            handles.append(handle)
    decision = Decision(lineage, batch, f"{fp}-{batch}", handles, epoch)
    ds.decide(decision, USCHEMA, False)
    ds.commit(decision)
    return decision


def test_upsert_options_are_checked_in_one_line(tmp_path):
    from onceflow import IcebergSink

    url = f"sqlite:///{tmp_path}/c.db"
    with pytest.raises(ConfigError, match="needs keys"):
        IcebergSink(url, "lake.t", write="upsert")
    with pytest.raises(ConfigError, match="write='upsert' only"):
        IcebergSink(url, "lake.t", order_by="ts")
    with pytest.raises(ConfigError, match="use 'append' or 'upsert'"):
        IcebergSink(url, "lake.t", write="merge", keys=["id"])
    ds = IcebergSink(url, "lake.t", write="upsert", keys=["nope"]).data_source()
    with pytest.raises(ConfigError, match="key column 'nope' is not a column of the stream"):
        ds.validate(USCHEMA, False)
    ds = IcebergSink(url, "lake.t", write="upsert", keys=["id"], order_by="when").data_source()
    with pytest.raises(ConfigError, match="order_by='when' is not a column"):
        ds.validate(USCHEMA, False)
    ds = IcebergSink(url, "lake.t", write="upsert", keys=["id"]).data_source()
    with pytest.raises(ConfigError, match="complete.*write='upsert' replaces rows by key in append mode"):
        ds.validate(USCHEMA, True)
    from onceflow.sinks.iceberg import IcebergDataSource
    ds = IcebergDataSource({"catalog": url, "table": "lake.t", "write": "upsert", "keys": "id",
                            "delete_column": "v"})
    with pytest.raises(ConfigError, match="delete column 'v' must be boolean"):
        ds.validate(USCHEMA, False)


def test_upsert_last_event_per_key_wins_across_tasks_and_with_order_by(tmp_path):
    """Within a batch: the largest order_by value wins; ties go to the later task partition,
    then the later row in the task (Arrow chunks of 2 rows: positions cross chunks); a null
    order_by loses. Without order_by, the batch order alone decides. Across batches the later
    batch wins."""
    ds = _upsert_source(tmp_path)
    lineage = str(uuid.uuid4())
    epoch = ds.open(lineage)
    _apply(ds, lineage, epoch, 0, [
        [(1, "a-late", 9), (2, "b-p0", 5), (3, "c-first", 1), (3, "c-last", 1), (4, "d", None)],
        [(1, "a-early", 2), (2, "b-p1", 5), (4, "d-ts", 0), (5, "e1", 1), (5, "e2", 1), (5, "e3", 1)],
    ])
    assert _state(ds) == {1: ("a-late", 9), 2: ("b-p1", 5), 3: ("c-last", 1), 4: ("d-ts", 0), 5: ("e3", 1)}
    _apply(ds, lineage, epoch, 1, [[(1, "a-next", 0)], [(6, "f", 1)]])  # a later batch wins, whatever ts
    assert _state(ds)[1] == ("a-next", 0) and _state(ds)[6] == ("f", 1)

    plain = _upsert_source(tmp_path / "plain", order_by=None)
    lin2 = str(uuid.uuid4())
    e2 = plain.open(lin2)
    _apply(plain, lin2, e2, 0, [[(1, "p0-last", 9), (2, "x", 1)], [(1, "p1-first", 0), (1, "p1-last", 0)]])
    assert _state(plain) == {1: ("p1-last", 0), 2: ("x", 1)}


def test_upsert_deletes_are_real_deletes_visible_to_any_reader(tmp_path):
    """A winning delete removes its key: pyiceberg's scan and a plain Parquet read of the
    current snapshot's data files (no delete files to apply) agree; a deleted absent key stays
    absent; a delete followed by an insert in a later batch brings the key back; the delete
    column is never written."""
    import pyarrow.parquet as pq

    ds = _upsert_source(tmp_path)
    lineage = str(uuid.uuid4())
    epoch = ds.open(lineage)
    _apply(ds, lineage, epoch, 0, [[(i, f"v{i}", 1) for i in range(10)]])
    _apply(ds, lineage, epoch, 1, [[(3, "del", 2), (4, "del", 2), (42, "del", 2)], [(5, "v5b", 2), (4, "back", 1)]])
    assert sorted(_state(ds)) == [0, 1, 2, 5, 6, 7, 8, 9] and _state(ds)[5] == ("v5b", 2)
    _apply(ds, lineage, epoch, 2, [[(3, "again", 3)]])
    table = ds._table()
    summary = table.current_snapshot().summary
    assert summary["total-delete-files"] == "0" and summary["total-records"] == "9"
    files = table.inspect.files().column("file_path").to_pylist()
    raw = pa.concat_tables([pq.read_table(f.removeprefix("file://")) for f in files])
    assert sorted(raw.column("id").to_pylist()) == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert "_onceflow_delete" not in raw.column_names and "_onceflow_delete" not in table.schema().column_names


def test_a_replayed_or_lost_reply_upsert_batch_applies_nothing(tmp_path):
    """A batch decided once: its decide retried, its commit replayed by a restarted driver
    (TwoPhaseCommitWriter.commit, the replay path), and a lost reply (the fault point
    ``after_catalog_commit``: the snapshot landed, the commit raised) followed by the restart:
    one snapshot per batch, nothing applied twice, staged files gone."""
    from onceflow.errors import InjectedCrash
    from onceflow.sinks.base import PreCommitted, TwoPhaseCommitWriter

    ds = _upsert_source(tmp_path)
    lineage = str(uuid.uuid4())
    ds.opts.update(lineage=lineage, allow_unknown_fingerprint="true")
    epoch = ds.open(lineage)
    decision = _apply(ds, lineage, epoch, 0, [[(1, "a", 1), (2, "b", 1)]])
    snapshots = len(ds._table().metadata.snapshots)
    ds.decide(decision, USCHEMA, False)  # a retried decide
    assert len(ds._table().metadata.snapshots) == snapshots

    ds.opts.update(test_crash_at="after_catalog_commit@1:raise", test_crash_markers=str(tmp_path))
    h, n = ds.pre_commit(TaskInfo(lineage, 1, 0, 0), USCHEMA, False, _events([(1, "del", 2), (3, "c", 2)]))
    with pytest.raises(InjectedCrash):
        TwoPhaseCommitWriter(ds, USCHEMA, False).commit([PreCommitted(lineage, 1, 0, 0, n, h)], 1)
    after = _state(ds)
    assert after == {2: ("b", 1), 3: ("c", 2)}

    restarted = _upsert_source(tmp_path)  # a new driver: a newer epoch, recovery, the replay
    restarted.opts.update(lineage=lineage, allow_unknown_fingerprint="true")
    restarted.open(lineage)
    assert restarted.is_decided(lineage, 1), "its tasks write nothing"
    TwoPhaseCommitWriter(restarted, USCHEMA, False).commit([PreCommitted(lineage, 1, 0, 0, 0, None, True)], 1)
    assert _state(restarted) == after
    table = restarted._table()
    batches = [s.summary.additional_properties.get("onceflow.batch") for s in table.metadata.snapshots]
    assert batches.count("0") == 1 and batches.count("1") == 1
    live = {p.rsplit("/", 1)[-1] for p in table.inspect.all_files().column("file_path").to_pylist()}
    fs, data = restarted._data_dir()
    assert sorted(os.listdir(data)) == sorted(live), "staged and failed files are deleted"


def _raced_upsert(tmp_path, races: int, other: Callable[[int], pa.Table]):
    """An upsert source opened on a new lineage with batch 0 applied ({1: a, 2: b}); from now
    on, each of its next ``races`` table loads is followed by another writer's append of
    ``other(n)`` (n = races left), between the decide's read and its commit."""
    from onceflow.sinks.iceberg import IcebergDataSource

    class RacedSource(IcebergDataSource):
        def _table(self):
            table = super()._table()
            if self.races and table is not None and self.opts.get("race") == "on":
                self.races -= 1
                super()._table().append(other(self.races))
            return table

    RacedSource.races = races
    ds = _upsert_source(tmp_path, cls=RacedSource)
    lineage = str(uuid.uuid4())
    epoch = ds.open(lineage)
    _apply(ds, lineage, epoch, 0, [[(1, "a", 1), (2, "b", 1)]])
    ds.opts["race"] = "on"
    return ds, lineage, epoch


def _assert_only_live_files(ds) -> None:
    """Every file in the table's data directory is one a snapshot references (no stray plan)."""
    live = {p.rsplit("/", 1)[-1] for p in ds._table().inspect.all_files().column("file_path").to_pylist()}
    assert sorted(os.listdir(ds._data_dir()[1])) == sorted(live)


def test_an_upsert_raced_by_another_writer_is_planned_again_on_top(tmp_path):
    """Another writer appends a row of a key the batch replaces, between the decide's read and
    its commit (twice): the catalog refuses the commit, the decide re-reads and re-plans on the
    new metadata, so the other writer's row of that key is replaced too (a rebased commit would
    leave it: a key twice) and its other row stays. The refused attempts' files are deleted."""
    ds, lineage, epoch = _raced_upsert(tmp_path, 2, lambda n: pa.table(
        {"id": pa.array([1, 100 + n], pa.int64()), "v": ["other", "other"], "ts": pa.array([0, 0], pa.int64())}))
    _apply(ds, lineage, epoch, 1, [[(1, "mine", 2)]])
    assert ds.races == 0, "both races happened"
    assert _state(ds) == {1: ("mine", 2), 2: ("b", 1), 100: ("other", 0), 101: ("other", 0)}
    _assert_only_live_files(ds)


def test_null_upsert_keys_are_refused_in_the_task_leaving_no_file(tmp_path):
    ds = _upsert_source(tmp_path)
    lineage = str(uuid.uuid4())
    ds.open(lineage)
    rows = pa.table({"id": pa.array([1, None], pa.int64()), "v": ["a", "b"], "ts": pa.array([1, 1], pa.int64()),
                     "_onceflow_delete": [False, False]})
    with pytest.raises(ConfigError, match="1 row.*null key column 'id'"):
        ds.pre_commit(TaskInfo(lineage, 0, 0, 0), USCHEMA, False, iter(rows.to_batches()))
    fs, data = ds._data_dir()
    assert not fs.exists(data) or os.listdir(data) == []


def test_a_job_upserts_and_deletes_through_spark(spark, tmp_path):
    """A Job with ``delete_when``: Spark computes the delete flag, the table never gets the
    column, and the final table is the last event per key (deleted keys absent), read through
    pyiceberg. A predicate Spark cannot analyse is a ConfigError in one line."""
    from pyiceberg.catalog.sql import SqlCatalog

    from onceflow import CheckpointConfig, IcebergSink, Job, fixed_delay

    catalog = f"sqlite:///{tmp_path}/catalog.db"
    bad = IcebergSink(catalog, "lake.j", write="upsert", keys=["k"], delete_when="nope = 1")
    with pytest.raises(ConfigError, match="delete_when='nope = 1'.*not a SQL predicate"):
        bad.prepare(spark.range(1))
    total = 3000
    sink = IcebergSink(catalog, "lake.j", write="upsert", keys=["k"], order_by="id", delete_when="id % 7 = 0")
    job = Job(name="iceberg-upsert", sink=sink,
              source=lambda s: (s.readStream.format("onceflow-sequence").option("total", total)
                                .option("rows_per_second", 10**9).option("max_rows_per_batch", 1000)
                                .option("partitions", 2).load()),
              transform=lambda df: df.selectExpr("id % 37 AS k", "id"),
              checkpoint=CheckpointConfig(str(tmp_path / "ckpt"), interval="0 s"),
              restart_strategy=fixed_delay(attempts=0, delay=0), stop_when_idle=1.0, master="local[2]")
    job.run(spark=spark)
    table = SqlCatalog("onceflow", uri=catalog).load_table("lake.j")
    assert table.schema().column_names == ["k", "id"]
    got = {r["k"]: r["id"] for r in table.scan().to_arrow().to_pylist()}
    last = {i % 37: i for i in range(total)}
    assert got == {k: i for k, i in last.items() if i % 7 != 0}


def test_doctor_reports_the_catalog_table_and_onceflow_lineages(tmp_path):
    """``onceflow doctor --iceberg CATALOG TABLE`` (before: no such option, a usage error):
    catalog, format version, partition spec, snapshot count, and each lineage's epoch, last
    batch and write kind from the snapshot summaries; a missing table fails (exit 1)."""
    from click.testing import CliRunner

    from onceflow.cli.doctor import doctor

    ds = _upsert_source(tmp_path)
    lineage = str(uuid.uuid4())
    epoch = ds.open(lineage)
    _apply(ds, lineage, epoch, 0, [[(1, "a", 1)]])
    _apply(ds, lineage, epoch, 1, [[(1, "del", 2)]])
    url = f"sqlite:///{tmp_path}/catalog.db"
    out = CliRunner().invoke(doctor, ["--iceberg", url, "lake.u"])
    assert out.exit_code == 0, out.output
    for text in ("sql catalog", "format_version: v2", "partition_spec: unpartitioned", "snapshots: 3 snapshot(s)",
                 f"lineage {lineage}: sink_id iceberg, upsert: epoch {epoch}, last decided batch 1, "
                 "2 decision snapshot(s)"):
        assert text in out.output, out.output
    missing = CliRunner().invoke(doctor, ["--iceberg", url, "lake.none"])
    assert missing.exit_code == 1 and "lake.none does not exist" in missing.output
    nowhere = CliRunner().invoke(doctor, ["--iceberg", f"sqlite:///{tmp_path}/none/c.db", "lake.u"])
    assert nowhere.exit_code == 1 and "no SQLite catalog at" in nowhere.output
    assert not (tmp_path / "none").exists(), "looking created nothing"


def test_upsert_on_a_composite_key_replaces_only_exact_matches(tmp_path):
    """keys=["a", "b"]: rows are matched on both columns (a semi-join, not per column), so
    (1, "x") replaced and (1, "y"), (2, "x") untouched although each shares a column value."""
    from onceflow import IcebergSink

    schema = StructType([StructField("a", LongType()), StructField("b", StringType()), StructField("n", LongType())])
    ds = IcebergSink(f"sqlite:///{tmp_path}/catalog.db", "lake.c", write="upsert", keys=["a", "b"]).data_source()
    ds.write_schema = schema
    ds.validate(schema, False)
    lineage = str(uuid.uuid4())
    epoch = ds.open(lineage)

    def batch(n: int, rows: list[tuple]) -> None:
        data = pa.table({"a": pa.array([r[0] for r in rows], pa.int64()), "b": [r[1] for r in rows],
                         "n": pa.array([r[2] for r in rows], pa.int64())})
        h, _ = ds.pre_commit(TaskInfo(lineage, n, 0, 0), schema, False, iter(data.to_batches()))
        ds.decide(Decision(lineage, n, f"fp{n}", [h], epoch), schema, False)

    batch(0, [(1, "x", 0), (1, "y", 0), (2, "x", 0), (2, "y", 0)])
    batch(1, [(1, "x", 1), (2, "y", 1), (2, "y", 2), (3, "z", 1)])
    got = sorted((r["a"], r["b"], r["n"]) for r in ds._table().scan().to_arrow().to_pylist())
    assert got == [(1, "x", 1), (1, "y", 0), (2, "x", 0), (2, "y", 2), (3, "z", 1)]


def test_an_upsert_raced_by_appends_of_other_keys_commits_its_first_plan(tmp_path):
    """Another writer appends rows of keys the batch does not touch between the decide's read
    and its commit, five times: each refused commit is tried again with the same plan on the new
    metadata (its files carry attempt 0), not planned again, and every row stays."""
    import logging

    ds, lineage, epoch = _raced_upsert(tmp_path, 5, lambda n: pa.table(
        {"id": pa.array([500 + n], pa.int64()), "v": ["other"], "ts": pa.array([0], pa.int64())}))
    logger, records = logging.getLogger("onceflow.sinks.iceberg.source"), []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        _apply(ds, lineage, epoch, 1, [[(1, "mine", 2)]])
    finally:
        logger.removeHandler(handler)
    assert ds.races == 0, "all five races happened"
    assert _state(ds) == {1: ("mine", 2), 2: ("b", 1)} | {500 + i: ("other", 0) for i in range(5)}
    added = ds._added(ds._table(), lineage, 1)
    assert added and all("-a0-" in name for name in added), added
    assert not [r for r in records if "planning again" in r.getMessage()]
    _assert_only_live_files(ds)


def test_an_upsert_is_not_starved_by_a_writer_appending_other_keys_all_the_time(tmp_path, monkeypatch):
    """Another writer appends rows of other keys while every upsert plan is written (the
    rewrite of the files holding the batch's keys is the slow part of a decide): a decide
    that planned again after each refused commit was refused every time (100 refusals, then a
    SinkError); with the plan kept after a refusal caused by appends of other keys, the retry
    writes nothing and lands, and every foreign row stays. The interleaving is placed, not
    timed: the foreign commit runs inside each plan's rewrite step."""
    from pyiceberg.catalog.sql import SqlCatalog

    from onceflow.sinks.iceberg import source

    ds = _upsert_source(tmp_path)
    lineage = str(uuid.uuid4())
    epoch = ds.open(lineage)
    n = 1000
    ds._table().append(pa.table({"id": pa.array(range(n), pa.int64()), "v": pa.array(["x"] * n),
                                 "ts": pa.array([0] * n, pa.int64())}))
    catalog = SqlCatalog("onceflow", uri=f"sqlite:///{tmp_path}/catalog.db")
    foreign, plans = [], []
    rewrites = source.rewrites

    def raced_rewrites(table, change):
        plans.append(1)
        foreign.append(-len(plans))  # another writer commits while this plan is written
        catalog.load_table("lake.u").append(pa.table({"id": pa.array([foreign[-1]], pa.int64()),
                                                      "v": ["other"], "ts": pa.array([0], pa.int64())}))
        yield from rewrites(table, change)

    monkeypatch.setattr(source, "rewrites", raced_rewrites)
    for batch in range(3):
        _apply(ds, lineage, epoch, batch, [[(batch, "mine", 1)]])
    assert len(plans) == 3, "each batch planned once: the refused commit's retry reused its plan"
    rows = ds._table().scan().to_arrow()
    ids = rows.column("id").to_pylist()
    assert len(ids) == len(set(ids)) == n + len(foreign)
    assert sorted(i for i in ids if i < 0) == sorted(foreign)
    mine = rows.filter(pa.compute.equal(rows.column("v"), "mine")).column("id").to_pylist()
    assert sorted(mine) == [0, 1, 2]


def test_a_partitioned_table_is_refused_when_the_query_starts_in_one_line(tmp_path):
    """The sink writes files that may span partitions; before, a partitioned table failed at the
    first commit (pyiceberg: "Cannot infer partition value") and restarted on the same error."""
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.partitioning import PartitionField, PartitionSpec
    from pyiceberg.schema import Schema
    from pyiceberg.transforms import IdentityTransform
    from pyiceberg.types import LongType as ILong
    from pyiceberg.types import NestedField

    from onceflow import IcebergSink

    catalog = SqlCatalog("onceflow", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/wh")
    catalog.create_namespace("lake")
    catalog.create_table("lake.p", schema=Schema(NestedField(1, "id", ILong(), required=False)),
                         partition_spec=PartitionSpec(PartitionField(1, 1000, IdentityTransform(), "id")))
    for write in ({}, {"write": "upsert", "keys": ["id"]}):
        ds = IcebergSink(f"sqlite:///{tmp_path}/catalog.db", "lake.p", **write).data_source()
        with pytest.raises(ConfigError, match="lake.p is partitioned") as e:
            ds.validate(SCHEMA, False)
        assert "\n" not in str(e.value) and "unpartitioned" in str(e.value)
