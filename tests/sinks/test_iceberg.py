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
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark.sql.types import LongType, StructField, StructType

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

    with pytest.raises(ConfigError, match="not supported yet"):
        IcebergSink(f"sqlite:///{tmp_path}/c.db", "lake.t", mode="upsert")
    with pytest.raises(ConfigError, match="namespace.name"):
        IcebergSink(f"sqlite:///{tmp_path}/c.db", "t").data_source()
    with pytest.raises(ConfigError, match="unknown option.*keys"):
        IcebergDataSource({"catalog": f"sqlite:///{tmp_path}/c.db", "table": "lake.t", "keys": "id"})
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


def test_lost_commit_replies_across_processes_leave_no_duplicate(tmp_path):
    """A few trials of benchmarks/iceberg_lost_reply.py (its 100-trial run is in the docs): a
    process SIGKILLed right after the catalog took its snapshot, a new process replays the
    batch and finds it decided; the independent count has no duplicate, gap or orphan file."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "iceberg_lost_reply.py"),
                          "--trials", "2", "--rows", "200", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["writers_killed"] == 2 and report["replays_that_found_their_batch_decided"] == 2
    assert (report["duplicates"], report["missing"], report["dangling_files"], report["rows"]) == (0, 0, 0, 400)


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
    checkpoint adds only new rows."""
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

    def run(total: int) -> None:
        df = (spark.readStream.format("onceflow-sequence").option("total", total)
              .option("rows_per_second", 10**9).option("max_rows_per_batch", 500).option("partitions", 2)
              .load().select("id"))
        q = (df.writeStream.format("onceflow-iceberg").option("catalog", catalog).option("table", "lake.plain")
             .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(processingTime="100 milliseconds")
             .start())
        deadline = time.monotonic() + 240
        while len(ids()) < total and q.exception() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        q.stop()
        assert q.exception() is None

    run(1000)
    run(1500)
    assert ids() == list(range(1500))


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
