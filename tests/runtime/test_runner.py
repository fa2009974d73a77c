"""JobRunner: state backends through crash and replay, batch timeout, min pause (real Spark)."""

from __future__ import annotations

import pytest

from onceflow.checkpoint.eventlog import EventLog
from onceflow.demo.job import transform as running_count
from onceflow.errors import GaveUp
from onceflow.job import CheckpointConfig, Job
from onceflow.runtime.restart import fixed_delay
from onceflow.sinks.delta import DeltaSink
from onceflow.verify.exactly_once import check_delta_table


def seq(total: int, per_batch: int):
    return lambda spark: (
        spark.readStream.format("onceflow-sequence").option("total", total)
        .option("rows_per_second", 10**9).option("max_rows_per_batch", per_batch).load()
    )


class CrashingDeltaSink(DeltaSink):
    """A Delta sink whose options carry a fault-injection rule (raise mode)."""

    def __init__(self, path, rule, markers):
        super().__init__(path)
        self.rule, self.markers = rule, markers

    def options(self):
        return {**super().options(), "test_crash_at": self.rule, "test_crash_markers": self.markers}


@pytest.mark.parametrize("backend", ["hashmap", "rocksdb"])
def test_stateful_job_exactly_once_through_replay(spark, tmp_path, backend):
    """A crash after the Delta commit replays the batch: the sink skips it, and the state
    (running count per key) must still advance exactly once — replayed tasks drain input."""
    (tmp_path / "m").mkdir()
    job = Job(
        name="counts", source=seq(4000, 1000), transform=running_count,
        sink=CrashingDeltaSink(str(tmp_path / "t"), "after_commit@1:raise", str(tmp_path / "m")),
        checkpoint=CheckpointConfig(str(tmp_path / "ckpt"), interval=0, state_backend=backend),
        restart_strategy=fixed_delay(attempts=2, delay=0), stop_when_idle=1.0,
    )
    job.run(spark=spark)
    report = check_delta_table(str(tmp_path / "t"), 4000)
    assert report.ok and report.state_errors == 0, report
    events = list(EventLog(str(tmp_path / "ckpt")).read())
    assert any(e["event"] == "sink_commit" and e["replay"] and e["batch"] == 1 for e in events)
    provider = spark.conf.get("spark.sql.streaming.stateStore.providerClass")
    assert ("RocksDB" in provider) == (backend == "rocksdb")


def test_batch_timeout_fails_the_attempt_and_uses_the_restart_strategy(spark, tmp_path):
    def slow(df):
        from pyspark.sql.functions import pandas_udf

        @pandas_udf("long")
        def sleepy(s):
            import time

            time.sleep(4)
            return s

        return df.withColumn("id", sleepy("id"))

    job = Job(
        name="slow", source=seq(100, 100), transform=slow, sink=DeltaSink(str(tmp_path / "t")),
        checkpoint=CheckpointConfig(str(tmp_path / "ckpt"), interval=0, batch_timeout="1 s"),
        restart_strategy=fixed_delay(attempts=1, delay=0),
    )
    with pytest.raises(GaveUp, match="BatchTimeout"):
        job.run(spark=spark)
    events = [e["event"] for e in EventLog(str(tmp_path / "ckpt")).read()]
    assert events.count("restart") == 1 and events[-1] == "gave_up"


def test_min_pause_between_batches(spark, tmp_path):
    job = Job(
        name="paused", source=seq(3000, 1000), sink=DeltaSink(str(tmp_path / "t")),
        checkpoint=CheckpointConfig(str(tmp_path / "ckpt"), interval=0, min_pause="1.5 s"),
        stop_when_idle=1.0,
    )
    job.run(spark=spark)
    commits = [e["ts"] for e in EventLog(str(tmp_path / "ckpt")).read() if e["event"] == "sink_commit"]
    assert len(commits) >= 3
    gaps = [b - a for a, b in zip(commits, commits[1:], strict=False)]
    assert min(gaps) >= 1.5, gaps


def _checkpoint_manager_of_a_run(spark, tmp_path, name: str) -> str:
    """Run a small job in a thread; the class of its query's checkpoint file manager."""
    import threading
    import time

    job = Job(name=name, source=seq(3000, 1000), sink=DeltaSink(str(tmp_path / name)),
              checkpoint=CheckpointConfig(str(tmp_path / f"{name}-ckpt"), interval=0), stop_when_idle=1.0)
    runner = threading.Thread(target=job.run, kwargs={"spark": spark})
    runner.start()
    manager = None
    while runner.is_alive() and manager is None:
        for q in spark.streams.active:
            if q.name == name:
                manager = q._jsq.streamingQuery().offsetLog().fileManager().getClass().getName()
        time.sleep(0.05)
    runner.join(timeout=120)
    assert manager is not None, "the job's query was never seen"
    return manager


def test_a_local_checkpoint_uses_the_filesystem_checkpoint_manager_and_leaves_the_session_alone(spark, tmp_path):
    """Spark's default manager ran ten processes per checkpoint file (``chmod``, ``readlink``)
    without Hadoop's native library: ~60 ms of every trigger. A session that names a manager
    keeps it, and the runner's setting does not outlive the query's start."""
    key = "spark.sql.streaming.checkpointFileManagerClass"
    assert spark.conf.get(key, None) is None
    assert _checkpoint_manager_of_a_run(spark, tmp_path, "fs").endswith(".FileSystemBasedCheckpointFileManager")
    assert spark.conf.get(key, None) is None
    chosen = "org.apache.spark.sql.execution.streaming.checkpointing.FileContextBasedCheckpointFileManager"
    spark.conf.set(key, chosen)
    try:
        assert _checkpoint_manager_of_a_run(spark, tmp_path, "fc") == chosen
        assert spark.conf.get(key) == chosen
    finally:
        spark.conf.unset(key)


def test_query_conf_sets_arrow_batches_and_the_local_checkpoint_manager_then_restores(spark, tmp_path):
    """A Job's query starts with 100,000-row Arrow batches for the sinks' Python writers (Spark's
    10,000 made a 1M-row batch 100 Python calls per task) and, on a local checkpoint, the
    FileSystem-based checkpoint manager; the session keeps its own settings and gets them back."""
    from onceflow.spark import ARROW_BATCH_CONF, LOCAL_CHECKPOINT_CONF, query_conf

    rows = "spark.sql.execution.arrow.maxRecordsPerBatch"
    with query_conf(spark, str(tmp_path / "ckpt")) as added:
        assert spark.conf.get(rows) == "100000"
        assert set(added) == set(ARROW_BATCH_CONF) | set(LOCAL_CHECKPOINT_CONF)
    assert spark.conf.get(rows, None) is None
    spark.conf.set(rows, "5000")  # the user's own setting wins; an object store keeps Spark's manager
    try:
        with query_conf(spark, "s3a://bucket/ckpt") as added:
            assert spark.conf.get(rows) == "5000" and set(added) == set(ARROW_BATCH_CONF) - {rows}
        assert spark.conf.get(rows) == "5000"
    finally:
        spark.conf.unset(rows)


def test_the_first_batchs_phases_come_from_its_run_not_from_an_idle_report_before_it(spark, tmp_path):
    """A query whose first trigger finds no data reports "no data" under the id of the batch not
    run yet (no ``addBatch``); the "recovered" event's phases took that report (0 s to execute:
    seen in the demo's takeovers, whose batch took 1.7 s)."""
    import time

    import pyarrow as pa
    import pyarrow.parquet as pq

    from onceflow.runtime.runner import _first_batch_phases

    src = tmp_path / "in"
    src.mkdir()
    df = spark.readStream.schema("id long").parquet(str(src))
    query = (df.writeStream.format("noop").option("checkpointLocation", str(tmp_path / "ckpt"))
             .trigger(processingTime="200 milliseconds").start())
    try:
        deadline = time.monotonic() + 60
        while not query.recentProgress:  # the idle report of batch 0
            assert time.monotonic() < deadline, "no progress report"
            time.sleep(0.05)
        assert query.recentProgress[0].batchId == 0 and "addBatch" not in query.recentProgress[0].durationMs
        pq.write_table(pa.table({"id": list(range(100))}), str(src / "part-0.parquet"))
        while not any(p.numInputRows for p in query.recentProgress):
            assert time.monotonic() < deadline, "batch 0 never ran"
            time.sleep(0.05)
        phases = _first_batch_phases(query, 0)
    finally:
        query.stop()
    ran = next(p for p in query.recentProgress if p.numInputRows)
    assert ran.batchId == 0
    assert phases["batch_s"] == round(ran.durationMs["triggerExecution"] / 1000, 3) > 0, phases
