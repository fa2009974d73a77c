"""The sink conformance suite: one behaviour contract, run against every sink and mode.

Every transactional sink must keep each record's effect exactly once through:

* the crash windows of the commit protocol (a fault in each: before pre-commit, after some
  tasks pre-committed, after the decision lookup, before decide, after decide, mid-commit,
  after commit before Spark's ``commits/N``), the query restarted in-process each time;
* zombies: real driver processes, each on its own "host" (a UTS namespace), SIGSTOPped at
  (i) after its decision lookup, its tasks pre-committed (before decide is the same case for
  the fence: nothing decided), (ii) between decide and commit. A warm standby is told to take over (as ``onceflow run`` promotes one when it sees
  the active driver die), takes the lease, opens the sink under a newer epoch and commits the
  batch; the zombie then gets SIGCONT, must commit nothing, and must exit as fenced (exit
  code 5).

After each run an independent reader (not the sink's code) checks the output: every id
exactly once, nothing dangling (orphan Parquet files or attempt directories, prepared
transactions). Delta runs with both write paths: ``delta`` (Arrow, Spark's Python data source)
and ``delta-jvm`` (Spark's Parquet writer under ``foreachBatch``, committed by the same code),
each also on a table partitioned by ``p = id % 32`` (``-part``; the reader also checks every
row's partition value). ``delta-upsert`` merges each batch on ``keys=["id"]``; as a second MERGE
of a batch would not change its rows, the raw log is also checked for one MERGE per batch.

Iceberg runs on an SQLite catalog and has one more window, ``after_catalog_commit``: the
catalog took the batch's snapshot and the commit raises as if its reply were lost; its output is
read back through pyiceberg's scan of the table's metadata. ``iceberg-upsert`` replaces rows on
``keys=["id"]`` (every id its own key, so a lost id still shows) with a ``delete_when`` that never
holds; as a second application of a batch would not change its rows, the snapshot history is
also checked for at most one snapshot per batch (every Iceberg case). ``iceberg-s3`` appends
into a warehouse on moto's S3 server (``s3a://`` URL), its options given only as
``Job(storage_options=...)``: tasks, recovery and pyiceberg's FileIO all reach the store through
them; it is read back by a catalog given pyiceberg's own ``s3.*`` properties, and its data
directory is listed with s3fs. ``delta-s3`` appends to a Delta table on the same server, options
also the job's only: its decisions are :class:`~onceflow.sinks.delta.log.StoreLog`'s conditional
creates of the next log entry, read back with delta-rs, its table directory listed with s3fs.

``sqlite`` is examples/sqlite_sink.py, the sink written outside the package that
docs/custom-sink.md walks through; it is read back with plain sqlite3.

Kafka runs on tansu, which does not hide aborted transactions from read_committed readers
(the sink's probe refuses exactly_once there; here it is bypassed). In these windows no
transaction that carries data is ever aborted, so counting every record is honest.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from onceflow.checkpoint.eventlog import EventLog
from onceflow.job import Job
from onceflow.verify.exactly_once import check_ids

SINKS = ["delta", "delta-jvm", "delta-part", "delta-jvm-part", "delta-upsert", "delta-s3", "postgres-two_phase",
         "postgres-idempotent", "kafka", "iceberg", "iceberg-upsert", "iceberg-s3", "sqlite"]
#: the crash windows and the zombie chains run minutes per sink: every sink and write path, and
#: partitioning on the Arrow path only (both writers' partitioned commits are also crashed and
#: replayed in test_delta_partitioned.py; the fence does not depend on partitioning)
CRASHED = [s for s in SINKS if s != "delta-jvm-part"]
#: sqlite (the example sink) passes the zombie chain too, left out for time (docs/custom-sink.md);
#: iceberg-s3 too (its fence is the catalog's, as iceberg's; it passed the chain in 160 s)
ZOMBIES = [s for s in SINKS if not s.endswith("-part") and s not in ("sqlite", "iceberg-s3", "delta-s3")]


# ---- the sinks under test ----------------------------------------------------------------------


@dataclass
class Case:
    """One sink and mode: how to build it, how to read its output independently."""

    kind: str
    env: dict[str, str]  # what the job file below needs to build the sink
    read_ids: Callable[[], list[int]]
    dangling: Callable[[], list[str]]
    #: fault points this sink has (a mid-commit window only where commit is several steps)
    points: tuple[str, ...] = ("before_precommit", "after_precommit", "after_decision_lookup",
                               "before_decide", "after_decide", "mid_commit", "after_commit")
    extra: dict[str, str] = field(default_factory=dict)


def _delta_case(tmp_path: Path, writer: str = "arrow", partitioned: bool = False, upsert: bool = False) -> Case:
    from deltalake import DeltaTable

    from onceflow.verify.readers import delta_dangling

    table = tmp_path / "table"

    def read_ids() -> list[int]:
        if not partitioned:
            return DeltaTable(str(table)).to_pyarrow_table(columns=["id"]).column("id").to_pylist()
        rows = DeltaTable(str(table)).to_pyarrow_table(columns=["id", "p"])
        ids, parts = rows.column("id").to_pylist(), rows.column("p").to_pylist()
        assert all(p == i % 32 for i, p in zip(ids, parts, strict=True)), "a row in the wrong partition"
        return ids

    kind = ("delta" if writer == "arrow" else f"delta-{writer}") + ("-part" if partitioned else "")
    kind += "-upsert" if upsert else ""
    env = {"TABLE": str(table), "WRITER": writer} | ({"PARTITION": "p"} if partitioned else {})
    env |= {"WRITE": "upsert"} if upsert else {}
    def dangling() -> list[str]:
        return delta_dangling(str(table)) + (merged_twice(table) if upsert else [])

    return Case(kind, env, read_ids, dangling)


def _delta_s3_case(tmp_path: Path, s3) -> Case:
    """The Arrow path into a Delta table on moto's S3 server (``s3a://``, the job's storage
    options only); dangling = units in the table directory that no log entry adds."""
    import pyarrow as pa
    import s3fs
    from deltalake import DeltaTable

    from onceflow.storage import delta_target

    url = f"s3a://{s3.bucket()}/table"
    target, opts = delta_target(url, s3.options)

    def read_ids() -> list[int]:
        return DeltaTable(target, storage_options=opts).to_pyarrow_table(columns=["id"]).column("id").to_pylist()

    def dangling() -> list[str]:
        fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=s3.endpoint, use_listings_cache=False)
        root = url.split("://", 1)[1]
        names = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root)} if fs.exists(root) else set()
        adds = DeltaTable(target, storage_options=opts).get_add_actions(flatten=True)
        live = {p.split("/", 1)[0] for p in pa.table(adds).column("path").to_pylist()}
        return sorted(n for n in names - live if n != "_delta_log")

    env = {"TABLE": url, "WRITER": "arrow", "STORAGE_OPTIONS": json.dumps(s3.options)}
    return Case("delta-s3", env, read_ids, dangling, DELTA_S3_POINTS)


#: delta-s3's crash windows in the suite: what the store changes is the tasks' writes (every
#: window), a failed task attempt's file (after_precommit), recovery's listing of an undecided
#: batch's files (before_decide), the decision's conditional create landing before the crash
#: (after_decide: the replay finds it decided) and the commit's clean-up (mid_commit).
DELTA_S3_POINTS = ("after_precommit", "before_decide", "after_decide", "mid_commit")


def merged_twice(table: Path) -> list[str]:
    """Batches with more than one MERGE in the raw log (commitInfo's onceflow entry): with
    every id its own key a second MERGE of a batch would not show in the rows."""
    seen: dict[tuple, int] = {}
    for entry in sorted((table / "_delta_log").glob("*.json")):
        for action in map(json.loads, entry.read_text().splitlines()):
            info = action.get("commitInfo") or {}
            meta = info.get("onceflow")
            if info.get("operation") == "MERGE" and meta:
                meta = json.loads(meta) if isinstance(meta, str) else meta
                key = (meta["lineage"], meta["batch"])
                seen[key] = seen.get(key, 0) + 1
    return [f"batch {b} of lineage {lin} merged {n} times" for (lin, b), n in seen.items() if n > 1]


def _postgres_case(pg, mode: str) -> Case:
    import psycopg

    table = f"conf_{uuid.uuid4().hex[:8]}"
    sink_id = f"c{uuid.uuid4().hex[:6]}"

    def query(sql: str) -> list:
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            return conn.execute(sql).fetchall()

    def read_ids() -> list[int]:
        return [r[0] for r in query(f"SELECT id FROM {table}")]

    def dangling() -> list[str]:
        return [r[0] for r in query(f"SELECT gid FROM pg_prepared_xacts WHERE gid LIKE 'onceflow:{sink_id}:%'")]

    points = Case.points if mode == "two_phase" else tuple(p for p in Case.points if p != "mid_commit")
    return Case(f"postgres-{mode}", {"DSN": pg.dsn, "PGTABLE": table, "MODE": mode, "SINK_ID": sink_id},
                read_ids, dangling, points)


def _iceberg_case(tmp_path: Path, upsert: bool = False, s3=None) -> Case:
    """A SQLite catalog, its warehouse local or (``s3``: the moto server) on S3; read back
    through pyiceberg's scan (the table's metadata), dangling = Parquet files in the table's
    data/ directory that no snapshot lists, and batches applied by more than one snapshot."""
    from pyiceberg.catalog.sql import SqlCatalog

    db, warehouse = tmp_path / "catalog.db", tmp_path / "warehouse"
    io: dict[str, str] = {}
    if s3 is not None:
        warehouse = f"s3a://{s3.bucket()}/wh"  # what Spark users write
        io = {"s3.endpoint": s3.endpoint, "s3.access-key-id": "testing", "s3.secret-access-key": "testing",
              "s3.region": "us-east-1"}

    def table():
        where = warehouse if s3 is not None else f"file://{warehouse}"
        return SqlCatalog("onceflow", uri=f"sqlite:///{db}", warehouse=where, **io).load_table("lake.conf")

    def listing(location: str) -> list[str]:
        if s3 is None:
            return os.listdir(Path(location.removeprefix("file://")) / "data")
        import s3fs

        fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=s3.endpoint, use_listings_cache=False)
        root = location.split("://", 1)[1] + "/data"
        return [p.rsplit("/", 1)[-1] for p in fs.ls(root)] if fs.exists(root) else []

    def read_ids() -> list[int]:
        return table().scan().to_arrow().column("id").to_pylist()

    def dangling() -> list[str]:
        t = table()
        live = {p.rsplit("/", 1)[-1] for p in t.inspect.all_files().column("file_path").to_pylist()}
        seen: dict[tuple[str, str], int] = {}
        for snap in t.metadata.snapshots:
            props = snap.summary.additional_properties if snap.summary else {}
            if "onceflow.batch" in props:
                key = (props["onceflow.lineage"], props["onceflow.batch"])
                seen[key] = seen.get(key, 0) + 1
        twice = [f"batch {b} of lineage {lin} applied {n} times" for (lin, b), n in seen.items() if n > 1]
        return sorted(n for n in listing(t.location()) if n.endswith(".parquet") and n not in live) + twice

    points = (*Case.points, "after_catalog_commit")
    if s3 is not None:  # what the store changes: recovery's and commit's clean-up, the lost reply
        points = S3_POINTS
    env = {"CATALOG": f"sqlite:///{db}", "WAREHOUSE": str(warehouse)} | ({"WRITE": "upsert"} if upsert else {})
    env |= {"STORAGE_OPTIONS": json.dumps(s3.options)} if s3 is not None else {}
    kind = "iceberg-upsert" if upsert else "iceberg-s3" if s3 is not None else "iceberg"
    return Case(kind, env, read_ids, dangling, points)


#: iceberg-s3's crash windows in the suite: the fence and the decision are the catalog's, as for
#: iceberg; the store changes the tasks' writes (every window), a failed task attempt's file
#: (after_precommit), recovery listing and deleting an undecided batch's files (before_decide),
#: the commit's clean-up of losing attempts (mid_commit) and the lost reply's re-read of the
#: metadata (after_catalog_commit). All eight windows passed on S3 too (153 s on the loaded
#: 2-core machine, 2026-11-27); these four keep the suite's time.
S3_POINTS = ("after_precommit", "before_decide", "mid_commit", "after_catalog_commit")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _sqlite_case(tmp_path: Path) -> Case:
    """examples/sqlite_sink.py, the worked example of docs/custom-sink.md, read with plain
    sqlite3; dangling = staged rows or handles left, and decided batches never committed."""
    import sqlite3
    from contextlib import closing

    db = tmp_path / "out.db"

    def query(sql: str) -> list:
        with closing(sqlite3.connect(db)) as conn:
            return conn.execute(sql).fetchall()

    def read_ids() -> list[int]:
        return [r[0] for r in query("SELECT id FROM conf")]

    def dangling() -> list[str]:
        return ([f"staged row of {r[0]}" for r in query("SELECT _handle FROM conf_staged")]
                + [f"handle {r[0]}" for r in query("SELECT handle FROM onceflow_handles")]
                + [f"batch {r[0]} decided, not committed"
                   for r in query("SELECT batch FROM onceflow_decisions WHERE committed = 0")])

    return Case("sqlite", {"SQLITE_DB": str(db), "EXAMPLES": str(EXAMPLES)}, read_ids, dangling)


def _kafka_case(bootstrap: str) -> Case:
    from confluent_kafka import Consumer, TopicPartition

    from kafka_broker import create_topic

    topic = f"conf-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, topic, 2)

    def read_ids() -> list[int]:
        c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"v-{uuid.uuid4().hex[:6]}",
                      "enable.auto.commit": False, "isolation.level": "read_uncommitted"})
        parts = [TopicPartition(topic, p) for p in range(2)]
        ends = {p.partition: c.get_watermark_offsets(p, timeout=10, cached=False)[1] for p in parts}
        c.assign([TopicPartition(topic, p, 0) for p in range(2)])
        out, deadline = [], time.monotonic() + 30
        while time.monotonic() < deadline:
            out += [int(m.value()) for m in c.consume(1000, 0.3) if m.error() is None]
            pos = {tp.partition: tp.offset for tp in c.position(parts)}
            if all(ends[p] == 0 or pos[p] >= ends[p] for p in ends):
                break
        c.close()
        return out

    points = tuple(p for p in Case.points if p != "mid_commit")  # commit is one step (no-op)
    return Case("kafka", {"BOOTSTRAP": bootstrap, "TOPIC": topic}, read_ids, lambda: [], points)


@pytest.fixture(scope="module")
def kafka_bootstrap() -> Iterator[str]:
    from kafka_broker import KafkaBroker
    from onceflow.sinks.kafka import close_all

    with KafkaBroker() as broker:
        yield broker.bootstrap
        close_all()  # this process's cached producers and marker readers


@pytest.fixture
def case(request, tmp_path) -> Iterator[Case]:
    from onceflow.storage import configure

    try:
        yield _case(request, tmp_path)
    finally:
        configure(None)  # a Job(storage_options=...) of the case registered them for the process


def _case(request, tmp_path) -> Case:
    kind = request.param
    if kind == "delta-s3":
        return _delta_s3_case(tmp_path, request.getfixturevalue("s3_server"))
    if kind.startswith("delta"):
        return _delta_case(tmp_path, "jvm" if "-jvm" in kind else "arrow", kind.endswith("-part"),
                           kind.endswith("-upsert"))
    if kind.startswith("postgres"):
        return _postgres_case(request.getfixturevalue("pg"), kind.split("-", 1)[1])
    if kind == "iceberg-s3":
        return _iceberg_case(tmp_path, s3=request.getfixturevalue("s3_server"))
    if kind.startswith("iceberg"):
        return _iceberg_case(tmp_path, kind.endswith("-upsert"))
    if kind == "sqlite":
        return _sqlite_case(tmp_path)
    return _kafka_case(request.getfixturevalue("kafka_bootstrap"))


# One job definition for in-process runs and for driver processes (built from the environment).
JOB_FILE = """
import json
import os
from onceflow import CheckpointConfig, Job, fixed_delay


def build_sink(env):
    kind = env["SINK_KIND"]
    if kind.startswith("delta"):
        from onceflow import DeltaSink
        if env.get("WRITE") == "upsert":  # every id its own key: a lost or doubled id shows
            return DeltaSink(env["TABLE"], write="upsert", keys=["id"])
        return DeltaSink(env["TABLE"], writer=env.get("WRITER", "arrow"),
                         partition_by=[env["PARTITION"]] if env.get("PARTITION") else None)
    if kind.startswith("postgres"):
        from onceflow import PostgresSink
        return PostgresSink(env["DSN"], env["PGTABLE"], mode=env["MODE"], create_table=True,
                            sink_id=env["SINK_ID"], commit_deadline=20)
    if kind.startswith("iceberg"):
        from onceflow import IcebergSink
        if env.get("WRITE") == "upsert":  # every id its own key; the delete flag column never set
            return IcebergSink(env["CATALOG"], "lake.conf", warehouse=env["WAREHOUSE"], write="upsert",
                               keys=["id"], delete_when="id < 0")
        return IcebergSink(env["CATALOG"], "lake.conf", warehouse=env["WAREHOUSE"])
    if kind == "sqlite":  # examples/sqlite_sink.py: a sink written outside onceflow (docs/custom-sink.md)
        import sys
        if env["EXAMPLES"] not in sys.path:
            sys.path.insert(0, env["EXAMPLES"])
        from sqlite_sink import SqliteSink
        return SqliteSink(env["SQLITE_DB"], "conf")
    from onceflow.sinks.kafka import KafkaSink
    # marker_start_step=0: every batch records the lineage's marker start, so restarted
    # drivers and new workers read from it through every crash window and zombie.
    sink = KafkaSink(env["BOOTSTRAP"], env["TOPIC"], marker_start_step=0,
                     producer_config={"batch.num.messages": 1, "linger.ms": 0})
    opts = sink.options() | {"skip_broker_probe": "true"}
    sink.options = lambda: opts
    return sink


TOTAL, PER_BATCH = int(os.environ["TOTAL"]), int(os.environ["PER_BATCH"])
RATE, KIND = int(os.environ.get("RATE", 10**9)), os.environ["SINK_KIND"]


def source(spark):
    return (spark.readStream.format("onceflow-sequence").option("total", TOTAL)
            .option("rows_per_second", RATE).option("max_rows_per_batch", PER_BATCH)
            .option("partitions", 3).load())


def transform(df):
    if KIND == "kafka":
        return df.selectExpr("CAST(id AS STRING) AS key", "CAST(id AS STRING) AS value")
    if KIND.endswith("-part"):
        return df.selectExpr("id", "id % 32 AS p")
    return df.select("id")


STORAGE = os.environ.get("STORAGE_OPTIONS")  # iceberg-s3, delta-s3: the job's only, none on the sink
job = Job(name="conformance", source=source, transform=transform, sink=build_sink(os.environ),
          checkpoint=CheckpointConfig(os.environ["CKPT"], interval=os.environ.get("INTERVAL", "0 s")),
          restart_strategy=fixed_delay(attempts=int(os.environ.get("ATTEMPTS", 10)), delay=0),
          stop_when_idle=float(os.environ.get("IDLE", "2")), master="local[2]",
          storage_options=json.loads(STORAGE) if STORAGE else None)
"""


def _job_module(tmp_path: Path, env: dict[str, str]):
    """The job file above, loaded in this process with ``env`` applied."""
    import importlib.util

    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(JOB_FILE))
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        spec = importlib.util.spec_from_file_location(f"conf_job_{uuid.uuid4().hex[:6]}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return module.job


def assert_exactly_once(case: Case, total: int) -> None:
    report = check_ids(case.read_ids(), total)
    assert report.ok, report
    assert case.dangling() == [], "dangling output left behind"


# ---- fencing at the sink level ------------------------------------------------------------------


def _data_source(case: Case, tmp_path: Path):
    """The sink's data source as the runner opens it (schema known, checkpoint unused)."""
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    job = _job_module(tmp_path, {"SINK_KIND": case.kind, "CKPT": str(tmp_path / "ckpt"),
                                 "TOTAL": "1", "PER_BATCH": "1", **case.env})
    if case.kind == "kafka":
        schema = StructType([StructField("key", StringType()), StructField("value", StringType())])
    elif case.kind.endswith("-part"):
        schema = StructType([StructField("id", LongType()), StructField("p", LongType())])
    else:
        schema = StructType([StructField("id", LongType())])
    ds = job.sink.data_source()
    ds.write_schema = schema
    ds.validate(schema, False)
    return ds, schema


@pytest.mark.parametrize("case", SINKS, indirect=True)
def test_an_older_epoch_can_never_decide(case: Case, tmp_path):
    """Driver A opens the sink, driver B opens it after A (a takeover while A was paused):
    every decide of A fails with FencedError and changes nothing, before and after B's
    decision; B's decision stands; a rival decision for B's batch is refused too."""
    from onceflow.errors import FencedError
    from onceflow.sinks.base import Decision

    lineage = str(uuid.uuid4())
    a, schema = _data_source(case, tmp_path)
    b, _ = _data_source(case, tmp_path)
    ea, eb = a.open(lineage), b.open(lineage)
    assert eb > ea
    with pytest.raises(FencedError, match="epoch"):
        a.decide(Decision(lineage, 0, "fp-a", [], ea), schema, False)
    assert a.decision(lineage, 0) is None
    b.decide(Decision(lineage, 0, "fp-b", [], eb), schema, False)
    b.decide(Decision(lineage, 0, "fp-b", [], eb), schema, False)  # a retry of the same decision
    with pytest.raises(FencedError):
        a.decide(Decision(lineage, 0, "fp-a", [], ea), schema, False)
    with pytest.raises(FencedError):
        b.decide(Decision(lineage, 0, "fp-rival", [], eb), schema, False)
    stored = b.decision(lineage, 0)
    assert stored is not None and stored.fingerprint == "fp-b" and stored.epoch == eb


@pytest.mark.parametrize("case", SINKS, indirect=True)
def test_a_zombie_replaying_a_batch_a_newer_driver_decided_is_fenced(case: Case, tmp_path):
    """Driver A (paused, then resumed) reaches commit for a batch its successor B already
    decided: A's commit raises FencedError instead of returning as a finished replay (Spark
    would then write ``commits/N`` for A, and sources would clean up what B still reads)."""
    from onceflow.errors import FencedError
    from onceflow.sinks.base import Decision, TwoPhaseCommitWriter

    lineage = str(uuid.uuid4())
    a, schema = _data_source(case, tmp_path)
    b, _ = _data_source(case, tmp_path)
    ea, eb = a.open(lineage), b.open(lineage)
    b.decide(Decision(lineage, 0, "unknown", [], eb), schema, False)
    for ds in (a, b):
        ds.opts.update(lineage=lineage, allow_unknown_fingerprint="true")
    with pytest.raises(FencedError, match="newer driver decided"):
        TwoPhaseCommitWriter(a, schema, False).commit([], 0)
    TwoPhaseCommitWriter(b, schema, False).commit([], 0)  # B's own replay finishes normally
    assert a.decision(lineage, 0).epoch == eb > ea


@pytest.mark.parametrize("case", ["postgres-idempotent", "kafka"], indirect=True)
def test_a_replay_skips_a_partition_only_when_it_read_the_same_rows(case: Case, tmp_path):
    """Sinks whose tasks commit partitions on their own (markers per batch and partition): a
    replay of a committed partition that reads the same rows, in another order and other
    Arrow chunks, is skipped; one that reads other rows under the same partition number
    raises ReplayMismatch and writes nothing."""
    import pyarrow as pa

    from onceflow.errors import ReplayMismatch
    from onceflow.sinks.base import TaskInfo

    def rows(ids: list[int], chunk: int) -> list:
        if case.kind == "kafka":
            cols = {"key": [str(i) for i in ids], "value": [str(i) for i in ids]}
        else:
            cols = {"id": ids}
        table = pa.table(cols)
        return table.to_batches(max_chunksize=chunk)

    lineage = str(uuid.uuid4())
    ds, schema = _data_source(case, tmp_path)
    ds.open(lineage)
    ds.pre_commit(TaskInfo(lineage, 0, 1, 0), schema, False, iter(rows([1, 2, 3, 4], 4)))
    ds.pre_commit(TaskInfo(lineage, 0, 1, 1), schema, False, iter(rows([4, 3, 2, 1], 1)))
    assert sorted(case.read_ids()) == [1, 2, 3, 4], "the same rows in another order: skipped"
    with pytest.raises(ReplayMismatch, match="other rows"):
        ds.pre_commit(TaskInfo(lineage, 0, 1, 2), schema, False, iter(rows([1, 2, 3, 5], 4)))
    assert sorted(case.read_ids()) == [1, 2, 3, 4]


@pytest.mark.parametrize("case", ["postgres-idempotent", "kafka"], indirect=True)
def test_replay_mismatch_names_the_visible_partitions_and_advises_no_duplicating_fork(case: Case, tmp_path):
    """Issue 28 point 2: partitions 0 and 2 of batch 4 are visible; a replay of partition 2
    that reads other rows raises ReplayMismatch naming both partitions and their rows, with
    advice that cannot duplicate them (same lineage, or a savepoint at or after batch 4),
    never a fork from a savepoint taken before the batch. The sink reports the same
    partitions to restore checks (``visible_partitions``)."""
    import pyarrow as pa

    from onceflow.errors import ReplayMismatch
    from onceflow.sinks.base import TaskInfo

    def rows(ids: list[int]) -> Iterator:
        strs = [str(i) for i in ids]
        return iter(pa.table({"key": strs, "value": strs} if case.kind == "kafka" else {"id": ids}).to_batches())

    lineage = str(uuid.uuid4())
    ds, schema = _data_source(case, tmp_path)
    ds.open(lineage)
    ds.pre_commit(TaskInfo(lineage, 4, 0, 0), schema, False, rows([1, 2, 3]))
    ds.pre_commit(TaskInfo(lineage, 4, 2, 0), schema, False, rows([7, 8]))
    with pytest.raises(ReplayMismatch) as raised:
        ds.pre_commit(TaskInfo(lineage, 4, 2, 1), schema, False, rows([7, 9]))
    msg = str(raised.value)
    assert f"partition(s) 0, 2 of batch 4 of lineage {lineage} (5 rows) are already visible" in msg, msg
    assert "at or after batch 4" in msg and "restart the SAME lineage" in msg, msg
    assert "taken before this batch with --fork" not in msg, msg
    assert sorted(case.read_ids()) == [1, 2, 3, 7, 8]
    assert ds.visible_partitions(lineage, 4) == {0: 3, 2: 2}
    assert ds.visible_partitions(lineage, 5) == {}


# ---- crash windows -----------------------------------------------------------------------------


@pytest.mark.timeout(600)  # 7-8 in-process restarts; a loaded 2-core machine took over 300 s
@pytest.mark.parametrize("case", CRASHED, indirect=True)
def test_crash_windows(spark, case: Case, tmp_path):
    """One fault per batch, each window once; the query restarts in-process after each."""
    total, per_batch = max(9000, 1000 * (len(case.points) + 2)), 1000  # a batch per fault, and more
    markers = tmp_path / "markers"
    markers.mkdir()
    rules = ",".join(f"{p}@{i + 1}:raise" for i, p in enumerate(case.points))
    env = {"SINK_KIND": case.kind, "CKPT": str(tmp_path / "ckpt"), "TOTAL": str(total),
           "PER_BATCH": str(per_batch), "IDLE": "1", **case.env}
    job: Job = _job_module(tmp_path, env)
    opts = job.sink.options() | {"test_crash_at": rules, "test_crash_markers": str(markers)}
    job.sink.options = lambda: opts  # type: ignore[method-assign]
    job.run(spark=spark)
    fired = sorted(n.split("-")[1] for n in os.listdir(markers))
    assert fired == sorted(case.points), f"faults that never fired prove nothing: {fired}"
    assert_exactly_once(case, total)
    events = list(EventLog(str(tmp_path / "ckpt")).read())
    epochs = [e["epoch"] for e in events if e["event"] == "sink_open"]
    assert epochs == sorted(set(epochs)) and len(epochs) >= 4, "each query start takes a newer epoch"


# ---- zombies -----------------------------------------------------------------------------------

PAUSES = ("after_decision_lookup@2", "after_decide@5")


def _start_driver(tmp_path: Path, env: dict[str, str], host: str, go: Path | None = None) -> subprocess.Popen:
    """A driver process in its own session, on its own host name (UTS namespace); with ``go``
    a warm standby that takes over (with takeover, as ``onceflow run`` promotes it) once
    ``go`` exists."""
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(JOB_FILE))
    cmd = ["unshare", "--uts", "sh", "-c", f'hostname {host} && exec "$@"', "driver",
           sys.executable, "-m", "onceflow.runtime.driver", str(job)]
    log = open(tmp_path / f"{host}.log", "w")  # noqa: SIM115 - closed with the process
    extra = {"ONCEFLOW_STANDBY_GO": str(go)} if go else {}
    return subprocess.Popen(cmd, env={**os.environ, **env, **extra}, start_new_session=True,
                            stdout=log, stderr=subprocess.STDOUT)


def _paused(marker: Path, timeout: float = 120) -> dict[str, int]:
    """Wait until a pause fault fired and its process group is stopped; its pgid and pid."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if marker.exists() and "pid=" in marker.read_text():
            info = dict(kv.split("=") for kv in marker.read_text().split())
            pid = int(info["pid"])
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    return {"pgid": int(info["pgid"]), "pid": pid}
        time.sleep(0.2)
    raise AssertionError(f"{marker.name}: the driver never paused there")


def _resume(paused: dict[str, int]) -> None:
    os.killpg(paused["pgid"], signal.SIGCONT)
    os.kill(paused["pid"], signal.SIGCONT)


def _wait_commit(ckpt: Path, batch: int, after: float, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(e["event"] == "sink_commit" and e["batch"] >= batch and e["ts"] > after
               for e in EventLog(str(ckpt)).read()):
            return
        time.sleep(0.2)
    raise AssertionError(f"no commit of batch {batch} or later by the successor")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ZOMBIES, indirect=True)
def test_zombie_drivers_are_fenced(case: Case, tmp_path):
    """Three drivers on three hosts, each taking over from a paused predecessor (see module doc)."""
    total, per_batch = 9000, 1000
    markers = tmp_path / "markers"
    markers.mkdir()
    ckpt = tmp_path / "ckpt"
    env = {"SINK_KIND": case.kind, "CKPT": str(ckpt), "TOTAL": str(total), "PER_BATCH": str(per_batch),
           "RATE": "4000", "INTERVAL": "200 ms", "IDLE": "3", "ATTEMPTS": "0",
           # No driver renews or re-reads the lease during the test, so the zombies are
           # stopped by the sinks' epochs alone (a TTL longer than the test: a holder that
           # did not renew for its TTL gives the lease up by its own clock).
           "ONCEFLOW_LEASE_RENEW_S": "3600", "ONCEFLOW_LEASE_TTL_S": "7200", "ONCEFLOW_CRASH_AT": ",".join(f"{p}:pause" for p in PAUSES),
           "ONCEFLOW_CRASH_MARKER_DIR": str(markers),
           # the standbys' warm-up query (about 10 CPU-s each) only makes their takeover faster;
           # the fence does not depend on it (tests/runtime/test_standby.py covers it)
           "ONCEFLOW_STANDBY_WARM_UP": "0", **case.env}
    # Hosts 2-3 are standbys from the start: each handover costs seconds, not a JVM start.
    drivers = [_start_driver(tmp_path, env, "host-1")]
    drivers += [_start_driver(tmp_path, env, f"host-{i}", tmp_path / f"go-{i}") for i in (2, 3)]
    try:
        zombie = None
        for i, point in enumerate(PAUSES):
            name, batch = point.split("@")
            stopped = _paused(markers / f"fired-{name}-{batch}", timeout=240)
            resumed_at = time.time()
            if zombie is not None:  # the previous zombie: its successor (now paused) took over
                _resume(zombie)
                assert drivers[i - 1].wait(timeout=90) == 5, (tmp_path / f"host-{i}.log").read_text()[-3000:]
            zombie = stopped
            (tmp_path / f"go-{i + 2}").touch()  # the successor takes over from the paused driver
            _wait_commit(ckpt, int(batch) + 1, resumed_at)
        _resume(zombie)
        assert drivers[1].wait(timeout=90) == 5, (tmp_path / "host-2.log").read_text()[-3000:]
        assert drivers[2].wait(timeout=240) == 0, (tmp_path / "host-3.log").read_text()[-3000:]
    finally:
        for d in drivers:
            if d.poll() is None:
                os.killpg(d.pid, signal.SIGCONT)
                os.killpg(d.pid, signal.SIGKILL)
    assert_exactly_once(case, total)
    events = list(EventLog(str(ckpt)).read())
    opened = [e["epoch"] for e in events if e["event"] == "sink_open"]
    assert opened == sorted(opened) and len(set(opened)) == len(opened) >= 3
    fenced = [e for e in events if e["event"] == "failed" and e.get("error") == "FencedError"]
    assert len(fenced) == 2, [e.get("cause") for e in fenced]
    # (i): the zombie's own decide was refused by the sink's epoch check. (ii) decided before
    # its pause; it may finish that commit (the decision is the one that stands), then fails
    # on its next step and finds the newer lease holder.
    assert "opened the sink since" in fenced[0]["cause"], (
        [(e["cause"], e.get("query_error")) for e in fenced], (tmp_path / "host-1.log").read_text()[-4000:])
    assert json.loads((ckpt / "metadata").read_text())["id"]
    assert "standby ready (warm-up off)" in (tmp_path / "host-3.log").read_text()  # ONCEFLOW_STANDBY_WARM_UP=0
