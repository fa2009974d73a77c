"""Delta sink: exactly-once through every crash window of docs/protocol.md section 5 (real Spark)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from onceflow.checkpoint.eventlog import EventLog
from onceflow.errors import CheckpointError, ConfigError, OnceflowError
from onceflow.job import CheckpointConfig, Job
from onceflow.runtime.restart import fixed_delay
from onceflow.sinks.delta import DeltaSink
from onceflow.verify.exactly_once import check_delta_table


def seq(total: int, per_batch: int):
    def source(spark):
        return (
            spark.readStream.format("onceflow-sequence")
            .option("total", total)
            .option("rows_per_second", 10_000_000)
            .option("max_rows_per_batch", per_batch)
            .load()
        )

    return source


def make_job(tmp_path, total=6000, per_batch=1000, name="t", extra_sink=None, **kw) -> Job:
    sink = DeltaSink(str(tmp_path / "table"))
    if extra_sink:
        sink_opts = sink.options() | extra_sink
        sink.options = lambda: sink_opts  # type: ignore[method-assign]
    return Job(
        name=name,
        source=seq(total, per_batch),
        sink=sink,
        checkpoint=CheckpointConfig(str(tmp_path / "ckpt"), interval=0),
        restart_strategy=fixed_delay(attempts=3, delay=0),
        stop_when_idle=1.0,
        **kw,
    )


def parquet_files(table_dir) -> set[str]:
    return {n for n in os.listdir(table_dir) if n.endswith(".parquet")}


def referenced(table_dir) -> set[str]:
    adds = DeltaTable(str(table_dir)).get_add_actions(flatten=True)
    return {os.path.basename(p) for p in pa.table(adds).column("path").to_pylist()}


def test_exactly_once_and_restart_continues_without_reprocessing(spark, tmp_path):
    make_job(tmp_path, total=5000).run(spark=spark)
    report = check_delta_table(str(tmp_path / "table"), 5000)
    assert report.ok, report
    commits_before = [e for e in EventLog(str(tmp_path / "ckpt")).read() if e["event"] == "sink_commit"]
    last_batch = max(e["batch"] for e in commits_before)

    make_job(tmp_path, total=8000).run(spark=spark)
    assert check_delta_table(str(tmp_path / "table"), 8000).ok
    commits = [e for e in EventLog(str(tmp_path / "ckpt")).read() if e["event"] == "sink_commit"]
    later = commits[len(commits_before):]
    assert later and all(e["batch"] > last_batch for e in later), "committed batches were re-run"
    assert not any(e["replay"] for e in commits)


# The crash-window matrix (raise in each window, restart in-process) is in
# tests/sinks/test_conformance.py, run against every sink; Delta under real driver SIGKILLs:
# test_sigkill_after_commit... below, tests/cli/test_demo.py and tests/verify/test_verify_cli.py.


def test_fingerprint_mismatch_stops_with_clear_error(spark, tmp_path):
    make_job(tmp_path, total=3000, per_batch=1000).run(spark=spark)
    ckpt = tmp_path / "ckpt"
    # Simulate restoring an older snapshot under the same lineage: forget batches >= 2.
    for sub in ("offsets", "commits"):
        for n in os.listdir(ckpt / sub):
            if n.isdigit() and int(n) >= 2:
                os.remove(ckpt / sub / n)
    with pytest.raises(OnceflowError, match="different source offsets.*--fork"):
        make_job(tmp_path, total=3000, per_batch=700).run(spark=spark)
    assert check_delta_table(str(tmp_path / "table"), 3000).ok


def test_complete_mode_replaces_table_each_batch(spark, tmp_path):
    def counts(df):
        return df.groupBy("key").count()

    job = make_job(tmp_path, total=4000, transform=counts, output_mode="complete")
    # A sink mode that contradicts the query's output mode is refused before anything runs.
    job.sink = DeltaSink(str(tmp_path / "table"), mode="append")
    with pytest.raises(ConfigError, match="does not match the query's output mode"):
        job.run(spark=spark)
    assert not (tmp_path / "table" / "_delta_log").exists()
    job.sink = DeltaSink(str(tmp_path / "table"))  # the mode follows the query: complete
    job.run(spark=spark)
    table = DeltaTable(str(tmp_path / "table"))
    rows = table.to_pyarrow_table().to_pylist()
    assert sorted((r["key"], r["count"]) for r in rows) == [(k, 250) for k in range(16)]
    # Every earlier version stays readable (recovery never deletes files of older versions).
    for v in range(table.version()):
        DeltaTable(str(tmp_path / "table"), version=v).to_pyarrow_table()


def test_decision_found_beyond_recent_history_and_cleanup_keeps_committed_files(tmp_path):
    """Another writer adds many versions after a batch commits; a replay of that batch must
    still find its decision (fingerprint and files) and must not delete its committed files."""
    import uuid

    import pyarrow.parquet as pq
    from pyspark.sql.types import LongType, StructField, StructType

    from onceflow.sinks.base import Decision
    from onceflow.sinks.delta import DeltaDataSource

    path = tmp_path / "table"
    path.mkdir()
    lineage = str(uuid.uuid4())
    ds = DeltaDataSource({"path": str(path)})
    schema = StructType([StructField("id", LongType())])
    ds.write_schema = schema
    epoch = ds.open(lineage)
    name = f"part-of-{lineage}-e{epoch}-b0000000001-p00000-a0-0123456789ab.parquet"
    data = pa.table({"id": pa.array([1, 2, 3], pa.int64())})
    pq.write_table(data, path / name)
    handle = {"path": name, "size": (path / name).stat().st_size, "rows": 3, "mtime": 0}
    ds.decide(Decision(lineage, 1, "fp-1", [handle], epoch), schema, False)
    for i in range(210):  # more than any fixed look-back window
        write_deltalake(str(path), pa.table({"id": pa.array([100 + i], pa.int64())}), mode="append")

    found = ds.decision(lineage, 1)
    assert found is not None and found.fingerprint == "fp-1"
    assert found.handles == [{"path": name}]
    ds.commit(found)
    assert ds.recover(lineage) == {"orphans_removed": 0}
    assert (path / name).exists()
    assert DeltaTable(str(path)).to_pyarrow_table().num_rows == 213


def test_a_table_replaced_under_the_cached_one_is_read_afresh(tmp_path):
    """The sink keeps the table loaded per process and reads only new log entries; a table
    deleted and created again at the same URL (another log) must not be read through the
    old state: batch 1 decided in the old table is undecided in the new one."""
    import uuid

    from pyspark.sql.types import LongType, StructField, StructType

    from onceflow.sinks.base import Decision
    from onceflow.sinks.delta import DeltaDataSource

    path = tmp_path / "table"
    lineage = str(uuid.uuid4())
    ds = DeltaDataSource({"path": str(path)})
    ds.write_schema = StructType([StructField("id", LongType())])
    epoch = ds.open(lineage)
    for b in range(3):
        ds.decide(Decision(lineage, b, f"fp-{b}", [], epoch), ds.write_schema, False)
    assert ds.is_decided(lineage, 1)
    shutil.rmtree(path)
    for i in range(2):  # a new table with a shorter log than the old one
        write_deltalake(str(path), pa.table({"id": pa.array([i], pa.int64())}), mode="append")
    assert not ds.is_decided(lineage, 1) and ds.decision(lineage, 1) is None
    assert ds.open(lineage) == 1  # a new table: its first epoch


def test_only_columns_with_few_distinct_values_are_dictionary_encoded(tmp_path):
    """A unique id column is written plain (dictionary-encoding it first and falling back
    doubled the encoding work); a low-cardinality column keeps its dictionary."""
    import pyarrow.parquet as pq
    from pyspark.sql.types import LongType, StructField, StructType

    from onceflow.sinks.base import TaskInfo
    from onceflow.sinks.delta import DeltaDataSource

    ds = DeltaDataSource({"path": str(tmp_path / "t")})
    schema = StructType([StructField("id", LongType()), StructField("k", LongType())])
    n = 200_000
    batches = pa.table({"id": pa.array(range(n), pa.int64()),
                        "k": pa.array([i % 100 for i in range(n)], pa.int64())}).to_batches(10_000)
    handle, rows = ds.pre_commit(TaskInfo("0" * 36, 0, 0, 0), schema, False, iter(batches))
    assert rows == n
    meta = pq.ParquetFile(tmp_path / "t" / handle["path"]).metadata.row_group(0)
    encodings = {meta.column(i).path_in_schema: meta.column(i).encodings for i in range(2)}
    assert not any("DICTIONARY" in e for e in encodings["id"]), encodings
    assert any("DICTIONARY" in e for e in encodings["k"]), encodings
    assert pq.read_table(tmp_path / "t" / handle["path"]).equals(pa.Table.from_batches(batches))


def test_bad_input_is_refused_with_nothing_written(spark, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match="not writable"):
        Job(name="t", source=seq(10, 10), sink=DeltaSink(str(tmp_path / "t")),
            checkpoint=CheckpointConfig(str(blocker / "ckpt"))).run(spark=spark)

    not_delta = tmp_path / "not_delta"
    not_delta.mkdir()
    (not_delta / "data.csv").write_text("a,b\n")
    job = make_job(tmp_path)
    job.sink = DeltaSink(str(not_delta))
    with pytest.raises(ConfigError, match="not a Delta table"):
        job.run(spark=spark)
    assert os.listdir(not_delta) == ["data.csv"]

    other = tmp_path / "other"
    write_deltalake(str(other), pa.table({"name": ["a"]}))
    job.sink = DeltaSink(str(other))
    with pytest.raises(ConfigError, match="do not match table"):
        job.run(spark=spark)
    assert DeltaTable(str(other)).version() == 0

    from onceflow.sinks.delta import DeltaDataSource

    with pytest.raises(ConfigError, match="unknown option.*colour"):
        DeltaDataSource({"path": str(tmp_path / "x"), "colour": "red"})
    with pytest.raises(ConfigError, match="mode='upsert'"):
        DeltaSink(str(tmp_path / "x"), mode="upsert").data_source()


def test_direct_writestream_use(spark, tmp_path):
    """Users who keep their own Spark code use the sink as a format."""
    q = (
        spark.readStream.format("onceflow-sequence").option("total", 3000)
        .option("rows_per_second", 10_000_000).option("max_rows_per_batch", 1000).load()
        .writeStream.format("onceflow-delta").option("path", str(tmp_path / "table"))
        .option("checkpointLocation", str(tmp_path / "ckpt")).start()
    )
    try:
        q.processAllAvailable()
    finally:
        q.stop()
    assert check_delta_table(str(tmp_path / "table"), 3000).ok


JOB_FILE = """
import os
from onceflow import Job, CheckpointConfig, DeltaSink, fixed_delay
job = Job(
    name="killable",
    source=lambda spark: spark.readStream.format("onceflow-sequence")
        .option("total", int(os.environ["TOTAL"])).option("rows_per_second", 20000)
        .option("max_rows_per_batch", 4000).load(),
    sink=DeltaSink(os.environ["TABLE"]),
    checkpoint=CheckpointConfig(os.environ["CKPT"], interval="200 ms"),
    restart_strategy=fixed_delay(attempts=0, delay=0),
    stop_when_idle=float(os.environ.get("IDLE", "2")),
    master="local[2]",
)
"""


def test_write_stream_gives_plain_spark_code_the_jobs_writer_and_fencing(spark, tmp_path):
    """``DeltaSink(path).write_stream(df, checkpoint)``: the writer a Job runs (Spark's own
    Parquet writer here: per-attempt directories in the log), a new epoch per start (the first
    start's sink can no longer decide), and a restart that writes nothing twice."""
    from onceflow.errors import FencedError
    from onceflow.sinks.base import Decision

    table, ckpt = str(tmp_path / "table"), str(tmp_path / "ckpt")

    def start(total: int):
        df = (spark.readStream.format("onceflow-sequence").option("total", total)
              .option("rows_per_second", 10_000_000).option("max_rows_per_batch", 1000).load())
        q = DeltaSink(table).write_stream(df, ckpt).start()
        try:
            q.processAllAvailable()
        finally:
            q.stop()

    start(3000)
    paths = pa.table(DeltaTable(table).get_add_actions(flatten=True)).column("path").to_pylist()
    assert paths and all("-d" in p.split("/")[0] for p in paths), "not the JVM writer's attempt directories"
    epochs = [json.loads(h["onceflow"])["epoch"] for h in DeltaTable(table).history() if "onceflow" in h]
    old = DeltaSink(table).data_source({"checkpointlocation": ckpt, "epoch": str(max(epochs))})
    start(3000)  # a restart of the finished query: nothing again
    assert check_delta_table(table, 3000).ok
    lineage = json.loads((tmp_path / "ckpt" / "metadata").read_text())["id"]
    with pytest.raises(FencedError):
        old.decide(Decision(lineage, 99, "f", [], max(epochs)), None, False)


def test_write_stream_starts_the_query_with_a_jobs_settings_and_leaves_the_sessions(spark, tmp_path):
    """Issue 32: ``write_stream(...).start()`` gives the query what a Job's query gets
    (``onceflow.spark.query_conf``): here Arrow batches of 100,000 rows into the Python
    writer, seen as the row groups of the written file (Spark's default would make row groups
    of 10,000). The session's own settings are untouched afterwards. Before: the query started
    with the session's settings (10,000-row row groups) unless the user wrapped ``start()``."""
    import pyarrow.parquet as pq

    from onceflow.spark import ARROW_BATCH_CONF

    key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    assert spark.conf.get(key, None) is None, "the session fixture names the setting: the test would prove nothing"
    table, ckpt = str(tmp_path / "table"), str(tmp_path / "ckpt")
    df = (spark.readStream.format("onceflow-sequence").option("total", 250_000).option("partitions", 1)
          .option("rows_per_second", 100_000_000).option("max_rows_per_batch", 250_000).load())
    writer = DeltaSink(table, writer="arrow").write_stream(df, ckpt).queryName("settings")
    q = writer.start()
    try:
        q.processAllAvailable()
    finally:
        q.stop()
    assert check_delta_table(table, 250_000).ok
    files = DeltaTable(table).file_uris()
    groups = [pq.ParquetFile(f).metadata.row_group(i).num_rows for f in files
              for i in range(pq.ParquetFile(f).metadata.num_row_groups)]
    assert max(groups) == int(ARROW_BATCH_CONF[key]), groups
    assert spark.conf.get(key, None) is None  # the session keeps its own


def start_driver(tmp_path, env_extra) -> subprocess.Popen:
    job_file = tmp_path / "job.py"
    job_file.write_text(textwrap.dedent(JOB_FILE))
    env = {**os.environ, "TABLE": str(tmp_path / "table"), "CKPT": str(tmp_path / "ckpt"), **env_extra}
    return subprocess.Popen(
        [sys.executable, "-m", "onceflow.runtime.driver", str(job_file)],
        env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def committed_batches(tmp_path) -> int:
    return sum(1 for e in EventLog(str(tmp_path / "ckpt")).read() if e["event"] == "sink_commit")


@pytest.mark.slow
def test_sigkill_after_commit_then_second_driver_refused_then_takeover(tmp_path):
    """Real processes: SIGKILL right after the Delta commit (before Spark's commits/N); a second
    driver is refused while the first lives; after the first is killed, the restart replays the
    batch without duplicating it; SIGTERM then stops it gracefully."""
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {"TOTAL": "1000000000", "ONCEFLOW_CRASH_AT": "after_commit@3:kill",
           "ONCEFLOW_CRASH_MARKER_DIR": str(markers)}
    first = start_driver(tmp_path, env)
    first.wait(timeout=120)
    assert first.returncode == -signal.SIGKILL, first.stderr.read()
    assert (markers / "fired-after_commit-3").exists()
    ckpt = tmp_path / "ckpt"
    assert not (ckpt / "commits" / "3").exists(), "crash came too late to test the window"

    second = start_driver(tmp_path, env)
    try:
        wait_for(lambda: committed_batches(tmp_path) >= 8, 120, "the restarted driver to commit")
        third = start_driver(tmp_path, env)
        out, err = third.communicate(timeout=60)
        assert third.returncode == 5 and "already running" in err, err  # fenced by the lease
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=90)
        assert second.returncode == 0, second.stderr.read()
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
    table = DeltaTable(str(tmp_path / "table")).to_pyarrow_table()
    top = max(table.column("id").to_pylist()) + 1
    report = check_delta_table(str(tmp_path / "table"), top)
    assert report.ok, report
    replays = [e for e in EventLog(str(ckpt)).read() if e["event"] == "sink_commit" and e["replay"]]
    assert [e["batch"] for e in replays] == [3]
    assert json.loads((ckpt / "metadata").read_text())["id"]  # lineage kept across restarts
    shutil.rmtree(markers)


EXECUTOR_JOB = """
import os
from onceflow import Job, CheckpointConfig, DeltaSink, fixed_delay
job = Job(
    name="executor-loss-delta",
    source=lambda spark: spark.readStream.format("onceflow-sequence")
        .option("total", int(os.environ["TOTAL"])).option("rows_per_second", 10**9)
        .option("max_rows_per_batch", 20000).option("partitions", 4).load(),
    sink=DeltaSink(os.environ["TABLE"], writer="arrow"),  # the fault fires in a Python task
    checkpoint=CheckpointConfig(os.environ["CKPT"], interval=0),
    restart_strategy=fixed_delay(attempts=0, delay=0),
    stop_when_idle=3.0,
    master="local-cluster[2,1,1024]",
    spark_conf={"spark.task.maxFailures": "8"},
)
"""


@pytest.mark.slow
def test_executor_lost_after_its_precommit(tmp_path):
    """On local-cluster[2,1,1024] a task SIGKILLs its own executor JVM right after its Parquet
    file became durable. Spark reruns the task elsewhere; the dead attempt's file is an orphan
    that must never become visible, and the query itself must not fail (no restart)."""
    total = 120_000
    markers = tmp_path / "markers"
    markers.mkdir()
    job_file = tmp_path / "job.py"
    job_file.write_text(textwrap.dedent(EXECUTOR_JOB))
    env = {**os.environ, "TABLE": str(tmp_path / "table"), "CKPT": str(tmp_path / "ckpt"),
           "TOTAL": str(total), "ONCEFLOW_CRASH_AT": "after_precommit@2:kill_executor",
           "ONCEFLOW_CRASH_MARKER_DIR": str(markers)}
    proc = subprocess.run([sys.executable, "-m", "onceflow.runtime.driver", str(job_file)],
                          env=env, capture_output=True, text=True, timeout=280, start_new_session=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert os.listdir(markers) == ["fired-after_precommit-2"], "the executor was never killed"
    assert "Lost executor" in out or "ExecutorLostFailure" in out, "the executor loss went unnoticed"
    report = check_delta_table(str(tmp_path / "table"), total)
    assert report.ok, report
    assert parquet_files(tmp_path / "table") == referenced(tmp_path / "table"), "orphan files left"
    events = list(EventLog(str(tmp_path / "ckpt")).read())
    assert not any(e["event"] == "restart" for e in events), "the query failed instead of continuing"


def test_files_a_woken_zombie_writes_late_are_removed_by_the_successors_next_commit(tmp_path):
    """A paused driver's task finishes its Parquet file after a successor took over, recovered
    and decided that batch. The successor's next commit removes the late file (no Spark: the
    sink's own classes in that order); files an older epoch legitimately committed stay."""
    import uuid

    import pyarrow.parquet as pq
    from pyspark.sql.types import LongType, StructField, StructType

    from onceflow.sinks.base import Decision
    from onceflow.sinks.delta import DeltaDataSource

    path = tmp_path / "table"
    path.mkdir()
    lineage = str(uuid.uuid4())
    schema = StructType([StructField("id", LongType())])

    def task_file(epoch: int, batch: int, ids: list[int]) -> dict:
        name = f"part-of-{lineage}-e{epoch}-b{batch:010d}-p00000-a0-{uuid.uuid4().hex[:12]}.parquet"
        pq.write_table(pa.table({"id": pa.array(ids, pa.int64())}), path / name)
        return {"path": name, "size": (path / name).stat().st_size, "rows": len(ids), "mtime": 0}

    zombie = DeltaDataSource({"path": str(path)})
    zombie.write_schema = schema
    old = zombie.open(lineage)
    first = task_file(old, 0, [0, 1])
    zombie.decide(Decision(lineage, 0, "fp-0", [first], old), schema, False)
    zombie.commit(Decision(lineage, 0, "fp-0", [first], old))

    successor = DeltaDataSource({"path": str(path)})
    successor.write_schema = schema
    new = successor.open(lineage)
    assert new > old
    replayed = task_file(new, 1, [2, 3])
    successor.decide(Decision(lineage, 1, "fp-1", [replayed], new), schema, False)
    successor.commit(Decision(lineage, 1, "fp-1", [replayed], new))
    late = task_file(old, 1, [2, 3])  # the woken zombie's task finishes batch 1
    nxt = task_file(new, 2, [4, 5])
    again = DeltaDataSource({"path": str(path), "epoch": str(new)})  # Spark: a new object per commit
    again.write_schema = schema
    again.decide(Decision(lineage, 2, "fp-2", [nxt], new), schema, False)
    again.commit(Decision(lineage, 2, "fp-2", [nxt], new))

    assert not (path / late["path"]).exists(), "the zombie's late file was left behind"
    assert (path / first["path"]).exists() and (path / replayed["path"]).exists()
    assert sorted(DeltaTable(str(path)).to_pyarrow_table().column("id").to_pylist()) == [0, 1, 2, 3, 4, 5]


# ---- the JVM write path (DeltaSink(writer="jvm")) -------------------------------------------------


def test_attempt_directories_are_cleaned_whole_and_seen_by_every_check(tmp_path):
    """The JVM path's per-attempt directories: validate() accepts them where it refuses a
    foreign file; the dangling check reports a directory the log does not reference; a batch's
    commit removes its losing attempt's directory whole (a half-written one with _temporary
    too), and a successor's recovery removes an older epoch's undecided one. No Spark: the
    sink's classes on directories written with pyarrow, in the order the JVM path uses them."""
    import uuid

    import pyarrow.parquet as pq
    from pyspark.sql.types import LongType, StructField, StructType

    from onceflow.sinks.base import Decision
    from onceflow.sinks.delta import DeltaDataSource
    from onceflow.sinks.delta.files import dir_name
    from onceflow.verify.readers import delta_dangling

    path = tmp_path / "table"
    lineage = str(uuid.uuid4())
    schema = StructType([StructField("id", LongType())])

    def attempt(epoch: int, batch: int, ids: list[int], half_written: bool = False) -> dict:
        name = dir_name(lineage, epoch, batch)
        (path / name).mkdir(parents=True)
        pq.write_table(pa.table({"id": pa.array(ids, pa.int64())}), path / name / "part-00000-x-c000.snappy.parquet")
        if half_written:
            (path / name / "_temporary" / "0").mkdir(parents=True)
        f = f"{name}/part-00000-x-c000.snappy.parquet"
        return {"path": f, "size": (path / f).stat().st_size, "rows": len(ids), "mtime": 0}

    attempt(0, 0, [9])  # a foreign-looking leftover of an older epoch, before the table exists
    ds = DeltaDataSource({"path": str(path)})
    ds.write_schema = schema
    ds.validate(schema, False)  # an attempt directory is the sink's own, not a foreign file
    (path / "notes.csv").write_text("x")
    with pytest.raises(ConfigError, match="not a Delta table"):
        DeltaDataSource({"path": str(path)}).validate(schema, False)
    (path / "notes.csv").unlink()

    epoch = ds.open(lineage)
    assert not any(p.is_dir() and p.name != "_delta_log" for p in path.iterdir()), "older epoch's orphan"
    lost, won, later = attempt(epoch, 0, [0, 1], half_written=True), attempt(epoch, 0, [0, 1]), attempt(epoch, 1, [2])
    lost_dir, won_dir, later_dir = (h["path"].split("/")[0] for h in (lost, won, later))
    assert delta_dangling(str(path)) == sorted(f"{d}/" for d in (lost_dir, won_dir, later_dir))
    decision = Decision(lineage, 0, "fp-0", [won], epoch)
    ds.decide(decision, schema, False)
    ds.commit(decision)
    assert not (path / lost_dir).exists() and (path / won_dir).exists()
    assert (path / later_dir).exists(), "the same epoch's next batch may be in flight"
    assert delta_dangling(str(path)) == [f"{later_dir}/"]

    successor = DeltaDataSource({"path": str(path)})
    successor.write_schema = schema
    assert successor.open(lineage) > epoch
    assert not (path / later_dir).exists() and delta_dangling(str(path)) == []
    assert sorted(DeltaTable(str(path)).to_pyarrow_table().column("id").to_pylist()) == [0, 1]


def test_jvm_writer_of_an_older_epoch_commits_nothing_and_its_directory_goes(spark, tmp_path):
    """A zombie's foreachBatch (epoch 1) runs after a successor opened the sink (epoch 2):
    Spark writes its attempt directory, its decide is refused (FencedError) and nothing
    becomes visible; the successor's run of the same batch commits it once and removes the
    zombie's directory. Replaying the decided batch writes nothing."""
    import uuid

    from onceflow.errors import FencedError
    from onceflow.sinks.delta import DeltaDataSource
    from onceflow.sinks.delta.jvm import JvmBatchWriter
    from onceflow.verify.readers import delta_dangling

    path = tmp_path / "table"
    lineage = str(uuid.uuid4())
    df = spark.range(0, 1000, numPartitions=2)
    opts = {"path": str(path), "writer": "jvm", "lineage": lineage, "allow_unknown_fingerprint": "true"}
    zombie, successor = DeltaDataSource(opts), DeltaDataSource(opts)
    for ds in (zombie, successor):
        ds.write_schema = df.schema
        ds.validate(df.schema, False)
    zombie.open(lineage)
    successor.open(lineage)
    with pytest.raises(FencedError, match="opened the sink since"):
        JvmBatchWriter(zombie, df.schema, False)(df, 0)
    assert DeltaTable(str(path)).to_pyarrow_table().num_rows == 0
    assert len(delta_dangling(str(path))) == 1, "the zombie's attempt directory"
    JvmBatchWriter(successor, df.schema, False)(df, 0)
    JvmBatchWriter(successor, df.schema, False)(df, 0)  # a replay of the decided batch
    ids = DeltaTable(str(path)).to_pyarrow_table().column("id").to_pylist()
    assert sorted(ids) == list(range(1000))
    assert delta_dangling(str(path)) == []


def test_jvm_writer_writes_plain_the_columns_whose_dictionary_did_not_pay(spark, tmp_path):
    """Parquet's writer tries a dictionary per column and drops it for unique values; the JVM
    path learns from the footers of one batch which columns those are and writes them plain
    (no wasted attempt) from the next batch on, keeping the dictionary where it pays."""
    import uuid

    import pyarrow.parquet as pq

    from onceflow.sinks.delta import DeltaDataSource
    from onceflow.sinks.delta.jvm import REPROBE_BATCHES, JvmBatchWriter

    path = tmp_path / "table"
    lineage = str(uuid.uuid4())

    def batch(n: int):
        return spark.range(n * 100_000, (n + 1) * 100_000, numPartitions=1).selectExpr("id", "id % 7 AS k")

    ds = DeltaDataSource({"path": str(path), "writer": "jvm", "lineage": lineage, "allow_unknown_fingerprint": "true"})
    ds.write_schema = batch(0).schema
    ds.validate(ds.write_schema, False)
    ds.open(lineage)
    writer = JvmBatchWriter(ds, ds.write_schema, False)
    writer(batch(0), 0)
    assert writer._plain == {"id"}
    writer(batch(1), 1)
    assert writer._plain == {"id"}
    files = DeltaTable(str(path)).file_uris()
    newest = [pq.read_metadata(f).row_group(0) for f in files if "-b0000000001-" in f]
    assert newest, files
    assert all(not g.column(0).has_dictionary_page and g.column(1).has_dictionary_page for g in newest)
    assert sorted(DeltaTable(str(path)).to_pyarrow_table().column("id").to_pylist()) == list(range(200_000))
    writer._batches = REPROBE_BATCHES - 1
    writer(batch(2), 2)
    assert writer._plain == frozenset(), "every REPROBE_BATCHES batches, dictionaries are tried again"



def units(table_dir) -> set[str]:
    """The units (task files, attempt directories) the table's log adds files from."""
    from onceflow.sinks.delta.files import unit

    return {unit(p) for p in pa.table(DeltaTable(str(table_dir)).get_add_actions(flatten=True)).column("path").to_pylist()}


def test_auto_writer_runs_jvm_for_a_local_table_in_a_job_and_arrow_elsewhere(spark, tmp_path):
    """``DeltaSink(path)`` (writer="auto") runs Spark's own Parquet writer for a local table on a
    classic session, the Arrow path for any other URL; a named writer is kept."""
    assert DeltaSink(str(tmp_path / "t")).writer == "auto"
    assert DeltaSink(str(tmp_path / "t")).for_session(spark).writer == "jvm"
    assert DeltaSink(f"file://{tmp_path}/t").for_session(spark).writer == "jvm"
    assert DeltaSink("s3://lake/t").for_session(spark).writer == "arrow"
    assert DeltaSink(str(tmp_path / "t"), writer="arrow").for_session(spark).writer == "arrow"
    with pytest.raises(ConfigError, match="use 'auto', 'arrow' or 'jvm'"):
        DeltaSink(str(tmp_path / "t"), writer="fast")
    make_job(tmp_path, total=3000).run(spark=spark)
    assert check_delta_table(str(tmp_path / "table"), 3000).ok
    assert units(tmp_path / "table") and all("-d" in u and not u.endswith(".parquet") for u in units(tmp_path / "table"))


def test_a_table_keeps_exactly_once_when_its_writer_changes_between_runs(spark, tmp_path):
    """One checkpoint, one table, three runs: arrow, then the default (jvm here), then arrow
    again. Each run continues after the last decided batch whichever writer decided it."""
    for total, writer in ((3000, "arrow"), (6000, "auto"), (9000, "arrow")):
        job = make_job(tmp_path, total=total)
        job.sink = DeltaSink(str(tmp_path / "table"), writer=writer)
        job.run(spark=spark)
        assert check_delta_table(str(tmp_path / "table"), total).ok, writer
    kinds = {u.endswith(".parquet") for u in units(tmp_path / "table")}
    assert kinds == {True, False}, "task files of the Arrow runs and attempt directories of the jvm run"
    commits = [e for e in EventLog(str(tmp_path / "ckpt")).read() if e["event"] == "sink_commit"]
    assert not any(e["replay"] for e in commits)


STOP_JOB = """
import os, time
from onceflow import CheckpointConfig, DeltaSink, Job, fixed_delay

def slow(batches):
    time.sleep(3)  # a batch's write is in flight most of the time
    yield from batches

job = Job(
    name="stop-jvm",
    source=lambda spark: spark.readStream.format("onceflow-sequence")
        .option("total", 10**9).option("rows_per_second", 2000)
        .option("max_rows_per_batch", 2000).option("partitions", 2).load()
        .mapInArrow(slow, "id long, key long, event_time timestamp"),
    sink=DeltaSink(os.environ["WORK"] + "/table", writer="jvm"),
    checkpoint=CheckpointConfig(os.environ["WORK"] + "/ckpt", interval=0),
    restart_strategy=fixed_delay(attempts=0, delay=0),
    master="local[2]",
)
"""


def _run_and_stop(work, env: dict[str, str] | None = None) -> str:
    """Run STOP_JOB, ``onceflow stop --savepoint`` it after 3 batches; the supervisor's output."""
    work.mkdir()
    (work / "job.py").write_text(STOP_JOB)
    env = {**os.environ, "WORK": str(work), **(env or {})}
    sup = subprocess.Popen([sys.executable, "-m", "onceflow", "run", "--no-standby", str(work / "job.py")],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (work / "ckpt" / "commits" / "2").exists():
            assert sup.poll() is None and time.monotonic() < deadline, "the job did not commit 3 batches"
            time.sleep(0.2)
        time.sleep(1.0)  # into the next batch's write
        stopper = subprocess.run([sys.executable, "-m", "onceflow", "stop", "--savepoint", str(work / "sp"),
                                  str(work / "ckpt")], env=env, capture_output=True, text=True, timeout=120)
        assert stopper.returncode == 0, stopper.stderr
        assert sup.wait(timeout=60) == 0
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)
        out = sup.communicate(timeout=60)[0]
    assert "StackOverflowError" not in out, out[-3000:]
    saved = json.loads((work / "sp" / "_savepoint.json").read_text())
    report = check_delta_table(str(work / "table"), saved["source_offsets"][0]["next"])
    assert report.ok, report
    return out


@pytest.mark.slow
def test_jvm_writer_stopped_mid_write_stops_cleanly_with_a_savepoint(tmp_path):
    """``onceflow stop --savepoint`` while Spark's write of a batch is in flight: the write is
    interrupted, and Spark must see that as the query stopping. Its check of the error our
    foreachBatch raised overflowed the stream thread's stack on a long Java stack trace
    (StackOverflowError; on a standalone cluster the stop then never finished). The table
    holds every id below the savepoint's offset exactly once. The runner stops the query once
    the in-flight batch ended; ONCEFLOW_STOP_LATE_S=1 makes that a second later, inside the
    next batch's 3-second write (before: eight runs at most, as a 250 ms poll fell in the next
    batch's write or in its planning by luck, 41-115 s)."""
    assert "Spark's write of batch" in _run_and_stop(tmp_path / "run", {"ONCEFLOW_STOP_LATE_S": "1"})
