"""seeds/000 for real: lose an executor JVM (SIGKILL) mid-batch on local-cluster[2,1,1024].

A task of batch 3 SIGKILLs its own executor JVM after the batch's first tasks have prepared
their transactions (it records how many were pending). The job keeps running on the other
executor and the replacement; afterwards every event id is in the PostgreSQL table exactly
once and no onceflow prepared transaction is left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psycopg
import pytest

from onceflow.verify.exactly_once import check_ids

JOB = """
import os
import signal
import time

from onceflow import CheckpointConfig, Job, PostgresSink, fixed_delay
from onceflow.faults import executor_jvm


def kill_my_executor_mid_batch(batches):
    from pyspark import TaskContext

    tc = TaskContext.get()
    if (tc.getLocalProperty("streaming.sql.batchId") == os.environ["KILL_BATCH"]
            and tc.partitionId() == int(os.environ["KILL_PARTITION"])):
        try:
            fd = os.open(os.environ["KILL_MARKER"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            fd = None
        if fd is not None:
            import psycopg

            time.sleep(1.0)  # the batch's partitions running elsewhere finish and PREPARE
            with psycopg.connect(os.environ["DSN"]) as conn:
                pending = conn.execute(  # this batch's prepared partitions
                    "SELECT count(*) FROM pg_prepared_xacts WHERE gid ~ %s",
                    [f"^onceflow:postgres:[^:]+:{os.environ['KILL_BATCH']}:[0-9]+:[0-9]+:e[0-9]+:[^:]+$"],
                ).fetchone()[0]
            jvm = executor_jvm()
            assert jvm is not None, "no executor JVM among this worker's ancestors"
            os.write(fd, f"{jvm} {pending}".encode())
            os.close(fd)
            os.kill(jvm, signal.SIGKILL)
            time.sleep(60)
    yield from batches


job = Job(
    name="executor-loss",
    source=lambda spark: spark.readStream.format("onceflow-sequence")
        .option("total", int(os.environ["TOTAL"])).option("rows_per_second", 10**9)
        .option("max_rows_per_batch", 10000).option("partitions", 4).load()
        .mapInArrow(kill_my_executor_mid_batch, "id long, key long, event_time timestamp"),
    sink=PostgresSink(os.environ["DSN"], "executor_loss", create_table=True),
    checkpoint=CheckpointConfig(os.environ["CKPT"], interval=0),
    restart_strategy=fixed_delay(attempts=3, delay=1),
    stop_when_idle=3.0,
    master="local-cluster[2,1,1024]",
    spark_conf={"spark.task.maxFailures": "8"},
)
"""


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_executor_sigkill_mid_batch_two_phase_postgres(pg_up, tmp_path):
    total = 100_000
    job_file = tmp_path / "job.py"
    job_file.write_text(textwrap.dedent(JOB))
    marker = tmp_path / "killed"
    env = {**os.environ, "TOTAL": str(total), "DSN": pg_up.dsn, "CKPT": str(tmp_path / "ckpt"),
           "KILL_BATCH": "3", "KILL_PARTITION": "2", "KILL_MARKER": str(marker)}
    log_path = tmp_path / "driver.log"
    with open(log_path, "w") as log:
        driver = subprocess.Popen(
            [sys.executable, "-m", "onceflow.runtime.driver", str(job_file)],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        driver.wait(timeout=360)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    out = log_path.read_text()
    assert driver.returncode == 0, out[-3000:]
    assert marker.exists(), "the executor was never killed: " + out[-2000:]
    _jvm, pending = map(int, marker.read_text().split())
    assert pending >= 1, "no prepared transaction of batch 3 was pending: the kill was not mid-batch"
    assert "Lost executor" in out and "exited with code 137" in out, "the SIGKILL went unnoticed"
    assert pg_up.password not in out

    with psycopg.connect(pg_up.dsn) as conn:
        ids = [r[0] for r in conn.execute("SELECT id FROM executor_loss")]
        dangling = conn.execute("SELECT gid FROM pg_prepared_xacts WHERE gid LIKE 'onceflow:postgres:%'").fetchall()
        handles = conn.execute("SELECT jsonb_array_length(handles) FROM onceflow_commit_log "
                               "WHERE sink = 'postgres' AND batch_id = 3").fetchall()
    report = check_ids(ids, total)
    assert report.ok, report
    assert dangling == []
    assert handles == [(4,)]  # batch 3 committed whole: its 4 partitions, one attempt each
