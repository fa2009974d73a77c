"""seeds/000 for real: lose an executor JVM (SIGKILL) mid-stream on local-cluster[2,1,1024].

The job keeps running on the surviving/replacement executor; afterwards every event id is in
the PostgreSQL table exactly once and no onceflow prepared transaction is left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psycopg
import pytest

from onceflow.checkpoint.eventlog import EventLog
from onceflow.verify.exactly_once import check_ids

JOB = """
import os
from onceflow import CheckpointConfig, Job, PostgresSink, fixed_delay

job = Job(
    name="executor-loss",
    source=lambda spark: spark.readStream.format("onceflow-sequence")
        .option("total", int(os.environ["TOTAL"])).option("rows_per_second", 10**9)
        .option("max_rows_per_batch", 20000).option("partitions", 4).load(),
    sink=PostgresSink(os.environ["DSN"], "executor_loss", create_table=True),
    checkpoint=CheckpointConfig(os.environ["CKPT"], interval=0),
    restart_strategy=fixed_delay(attempts=3, delay=1),
    stop_when_idle=3.0,
    master="local-cluster[2,1,1024]",
    spark_conf={"spark.task.maxFailures": "8"},
)
"""


def executors_of(session: int) -> list[int]:
    """Executor JVMs (CoarseGrainedExecutorBackend) in the driver's session."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
            if b"CoarseGrainedExecutorBackend" in cmd and os.getsid(int(entry)) == session:
                pids.append(int(entry))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return pids


@pytest.mark.slow
def test_executor_sigkill_mid_stream_two_phase_postgres(pg_up, tmp_path):
    total = 240_000
    job_file = tmp_path / "job.py"
    job_file.write_text(textwrap.dedent(JOB))
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "TOTAL": str(total), "DSN": pg_up.dsn, "CKPT": str(ckpt)}
    log_path = tmp_path / "driver.log"
    with open(log_path, "w") as log:
        driver = subprocess.Popen(
            [sys.executable, "-m", "onceflow.runtime.driver", str(job_file)],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        deadline = time.time() + 240
        commits = 0
        while time.time() < deadline and driver.poll() is None:
            commits = sum(1 for e in EventLog(str(ckpt)).read() if e["event"] == "sink_commit")
            if commits >= 3:
                break
            time.sleep(0.2)
        assert commits >= 3, "the job never got going: " + log_path.read_text()[-2000:]
        victims = executors_of(driver.pid)
        assert len(victims) == 2, f"expected 2 executors, found {victims}"
        os.kill(victims[0], signal.SIGKILL)
        driver.wait(timeout=300)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    out = log_path.read_text()
    assert driver.returncode == 0, out[-3000:]
    assert "Lost executor" in out or "ExecutorLostFailure" in out, "the executor loss went unnoticed"

    with psycopg.connect(pg_up.dsn) as conn:
        ids = [r[0] for r in conn.execute("SELECT id FROM executor_loss")]
        dangling = conn.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE gid LIKE 'onceflow:%'"
        ).fetchall()
    report = check_ids(ids, total)
    assert report.ok, report
    assert dangling == []
