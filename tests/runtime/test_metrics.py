"""``onceflow run --metrics-port``: Prometheus metrics with Flink's names, from a live driver;
the same run checks ``--master``/``--conf`` over the job's own settings and the Spark UI's default."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

JOB = textwrap.dedent(
    """
    import json, os
    from onceflow import CheckpointConfig, DeltaSink, Job, fixed_delay

    def source(spark):
        sc = spark.sparkContext
        with open(os.environ["WORK"] + "/session.json", "w") as f:
            json.dump({"master": sc.master, "ui": sc.uiWebUrl,
                       "shuffle": spark.conf.get("spark.sql.shuffle.partitions"),
                       "tz": spark.conf.get("spark.sql.session.timeZone")}, f)
        return (spark.readStream.format("onceflow-sequence").option("total", 20000)
                .option("rows_per_second", 2000).option("max_rows_per_batch", 1000).load())

    job = Job(name="metered", source=source, sink=DeltaSink(os.environ["WORK"] + "/table"),
              checkpoint=CheckpointConfig(os.environ["WORK"] + "/ckpt", interval=0),
              restart_strategy=fixed_delay(attempts=1, delay=0), stop_when_idle=1.0,
              master="local[2]", spark_conf={"spark.sql.shuffle.partitions": "5"})
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("onceflow_job_"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
    return out


def test_the_active_driver_serves_flink_named_metrics_and_the_command_line_wins(tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "ONCEFLOW_SPARK_CONF"}  # the user's default: UI on
    env["WORK"] = str(tmp_path)
    sup = subprocess.Popen([sys.executable, "-m", "onceflow", "run", "--no-standby", "--metrics-port", str(port),
                            "--master", "local[1]", "--conf", "spark.ui.port=4077",
                            "--conf", "spark.sql.shuffle.partitions=3", str(tmp_path / "job.py")],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, m = time.monotonic() + 180, {}
        while time.monotonic() < deadline:
            assert sup.poll() is None, sup.communicate()
            try:
                m = _scrape(port)
            except OSError:
                m = {}
            if m.get("onceflow_job_numberOfCompletedCheckpoints", 0) >= 3 and m.get("onceflow_job_numRecordsOut_total", 0) > 0:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"no committed batches in the metrics: {m}")
    finally:
        sup.terminate()
        sup.communicate(timeout=120)
    # Both counted; In can trail Out by the last batch (the driver records a batch's progress
    # a moment after the sink committed it), so the two are compared in the next test.
    assert m["onceflow_job_numRecordsIn_total"] > 0 and m["onceflow_job_numRecordsOut_total"] > 0
    assert m["onceflow_job_uptime"] > 0 and m["onceflow_job_numRestarts"] == 0
    assert m["onceflow_job_lastCheckpointDuration"] > 0
    for name in ("numberOfFailedCheckpoints", "lastCheckpointSize", "replayedRecordsSkipped_total",
                 "replayedBatchesSkipped_total"):
        assert f"onceflow_job_{name}" in m, name

    session = json.loads((tmp_path / "session.json").read_text())
    assert session["master"] == "local[1]"  # --master over Job.master
    assert session["shuffle"] == "3"  # --conf over Job.spark_conf over onceflow's default (4)
    assert session["tz"] == "UTC"  # onceflow's default where nobody said otherwise
    assert session["ui"] and ":40" in session["ui"], session  # the UI is on, at 4077 or the next free port


def test_replays_restarts_and_a_half_written_line_are_counted_right(tmp_path):
    from onceflow.checkpoint.eventlog import EventLog
    from onceflow.runtime.metrics import EventLogCollector

    ckpt = str(tmp_path / "ckpt")
    log = EventLog(ckpt)
    log.append("batch", batch=0, input_rows=100, duration_ms=50, state_bytes=7)
    log.append("sink_commit", batch=0, rows=100, replay=False)
    log.append("restart", cause="killed by SIGKILL", scope="process")
    log.append("batch", batch=0, input_rows=100, duration_ms=40, state_bytes=9)  # the replay
    log.append("sink_commit", batch=0, rows=0, replay=True)
    c = EventLogCollector(ckpt, "j")
    with open(log.path, "a") as f:
        f.write('{"ts": 1, "event": "batch", "batch": 1, "input_rows": 5')  # still being written
    c.update()
    assert (c.completed, c.restarts, c.failed, c.records_in, c.records_out) == (2, 1, 1, 200, 100)
    assert (c.replay_batches, c.replay_records, c.last_duration_ms, c.last_state_bytes) == (1, 100, 40, 9)
    with open(log.path, "a") as f:
        f.write(', "duration_ms": 30}\n')
    c.update()
    assert (c.completed, c.records_in, c.last_duration_ms) == (3, 205, 30)
