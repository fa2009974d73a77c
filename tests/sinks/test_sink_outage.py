"""A sink that is down while the job runs and restarts is an outage, never the end of the job.

seeds/002's question, with real processes: PostgreSQL is stopped for 30 s (ten commit deadlines) while an
``onceflow run`` job (two_phase) is committing; every open, recovery and commit meanwhile
fails and is retried by the restart strategy, each attempt logged with what waits. When the
server is back the job finishes exactly-once with nothing left prepared.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import psycopg
import pytest

from onceflow.checkpoint.eventlog import EventLog
from onceflow.verify.exactly_once import check_ids

JOB = """
import os
from onceflow import CheckpointConfig, Job, PostgresSink, fixed_delay
job = Job(
    name="pg-outage",
    source=lambda spark: spark.readStream.format("onceflow-sequence")
        .option("total", int(os.environ["TOTAL"])).option("rows_per_second", 400)
        .option("max_rows_per_batch", 2000).option("partitions", 2).load(),
    sink=PostgresSink(os.environ["DSN"], os.environ["PGTABLE"], create_table=True,
                      sink_id=os.environ["SINK_ID"], commit_deadline=3),
    checkpoint=CheckpointConfig(os.environ["CKPT"], interval="500 ms"),
    restart_strategy=fixed_delay(attempts=1000, delay="3 s"),
    stop_when_idle=3.0,
)
"""


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_postgres_down_for_30s_under_onceflow_run_waits_then_finishes_exactly_once(pg_up, tmp_path):
    pg, total = pg_up, 8_000
    table, sink_id = f"outage_{uuid.uuid4().hex[:8]}", f"o{uuid.uuid4().hex[:6]}"
    (tmp_path / "job.py").write_text(textwrap.dedent(JOB))
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "DSN": pg.dsn, "PGTABLE": table, "SINK_ID": sink_id, "CKPT": str(ckpt),
           "TOTAL": str(total)}
    log = open(tmp_path / "run.log", "w+")  # noqa: SIM115 - read after the run
    run = subprocess.Popen([sys.executable, "-m", "onceflow", "run", str(tmp_path / "job.py"), "--no-standby"],
                           env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 150
        while sum(e["event"] == "sink_commit" for e in EventLog(str(ckpt)).read()) < 3:
            assert time.time() < deadline and run.poll() is None, "the job never committed"
            time.sleep(0.2)
        pg.stop()
        time.sleep(30)
        assert run.poll() is None, "the job gave up while PostgreSQL was down"
        pg.start()
        assert run.wait(timeout=240) == 0
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    log.seek(0)
    out = log.read()
    assert pg.password not in out
    waits = [ln for ln in out.splitlines() if "unreachable" in ln and "retry" in ln]
    assert waits and "127.0.0.1" in waits[0], out[-3000:]
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        ids = [r[0] for r in conn.execute(f"SELECT id FROM {table}")]
        left = conn.execute("SELECT count(*) FROM pg_prepared_xacts WHERE gid LIKE %s",
                            [f"onceflow:{sink_id}:%"]).fetchone()[0]
    report = check_ids(ids, total)
    assert report.ok, report
    assert left == 0, "prepared transactions left behind"
    restarts = [e for e in EventLog(str(ckpt)).read() if e["event"] == "restart"]
    assert restarts and all(e.get("scope") == "query" for e in restarts), "outages restart the query in-process"
