"""Spark Connect: a Job whose queries run on a Connect server started from the PySpark
installation, under ``onceflow run --remote`` with driver SIGKILLs; a query whose driver died
stops committing; clear refusals where Connect cannot work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from onceflow.checkpoint.layout import CheckpointDir
from onceflow.verify import procs
from onceflow.verify.exactly_once import check_delta_table
from spark_cluster import free_port
from spark_connect import ConnectServer

JOB = textwrap.dedent(
    """
    import os
    from onceflow import CheckpointConfig, DeltaSink, Job, fixed_delay
    from onceflow.demo.job import transform

    def source(spark):
        return (spark.readStream.format("onceflow-sequence")
                .option("total", int(os.environ["TOTAL"])).option("rows_per_second", int(os.environ["RATE"]))
                .option("max_rows_per_batch", 1000).option("keys", 16).load())

    job = Job(name="connect-counts", source=source, transform=transform,
              sink=DeltaSink(os.environ["WORK"] + "/table"),
              checkpoint=CheckpointConfig(os.environ["WORK"] + "/ckpt", interval=0),
              restart_strategy=fixed_delay(attempts=5, delay=0), stop_when_idle=1.0)
    """
)


@pytest.fixture(scope="module")
def connect(tmp_path_factory):
    server = ConnectServer(str(tmp_path_factory.mktemp("connect")))
    yield server
    server.stop()


def _events(work) -> list[dict]:
    path = work / "ckpt/_onceflow/events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")] if path.exists() else []


def _wait(cond, what: str, proc: subprocess.Popen | None = None, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc is None or proc.poll() is None, f"exited {proc.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _setup(tmp_path, total: int, rate: int) -> tuple:
    work = tmp_path / "job"
    work.mkdir()
    (work / "job.py").write_text(JOB)
    env = {**os.environ, "WORK": str(work), "TOTAL": str(total), "RATE": str(rate)}
    return work, env, CheckpointDir(str(work / "ckpt"))


def test_driver_kills_under_onceflow_run_remote_exactly_once(connect, tmp_path):
    """Two driver SIGKILLs while the (stateful) query runs on the Connect server: the standby
    takes over, the dead driver's query is stopped or fenced, every id committed once."""
    work, env, ckpt = _setup(tmp_path, 16000, 2000)
    sup = subprocess.Popen([sys.executable, "-m", "onceflow", "run", "--remote", connect.url, str(work / "job.py")],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    killed: list[int] = []

    def running() -> list[int]:  # drivers that started and were not killed yet, newest last
        return [e["pid"] for e in _events(work) if e["event"] == "start" and e["pid"] not in killed]

    try:
        for kill in range(2):
            # The killed driver's query runs on in the server until its lease check stops it,
            # so commits alone do not say that the standby took over: wait for its start.
            _wait(lambda: running(), f"a driver to kill ({kill})", sup)
            before = len(ckpt.committed_batches())
            _wait(lambda b=before: len(ckpt.committed_batches()) >= b + 3, f"commits before kill {kill}", sup)
            killed.append(running()[-1])
            os.killpg(killed[-1], signal.SIGKILL)
        assert sup.wait(timeout=180) == 0
    finally:
        if sup.poll() is None:  # the supervisor, and its drivers and standby (their own groups)
            procs.signal_all([*procs.tree(sup.pid), *procs.with_env("WORK", str(work))], signal.SIGKILL)
        out = sup.communicate(timeout=60)[0]
    report = check_delta_table(str(work / "table"), 16000)
    assert report.ok and report.state_errors == 0, (report, out[-3000:])
    starts = [e for e in _events(work) if e["event"] == "start"]
    assert len(starts) == 3 and [s["lease_epoch"] for s in starts] == [1, 2, 3]


def test_a_query_whose_driver_died_stops_committing(connect, tmp_path):
    """Over Connect the query runs on the server: a SIGKILLed client leaves it running. Its
    commits check the driver's lease, so it stops within a lease TTL of the death."""
    work, env, ckpt = _setup(tmp_path, 10**9, 2000)
    env["ONCEFLOW_LEASE_TTL_S"] = "3"
    code = (f"import runpy; job = runpy.run_path({str(work / 'job.py')!r})['job']; "
            f"job.remote = {connect.url!r}; job.run()")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait(lambda: len(ckpt.committed_batches()) >= 3, "three commits", proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    _wait(lambda: "DriverLeaseLapsed" in connect.server_log(), "the query to stop", timeout=60)
    settled = len(ckpt.committed_batches())
    time.sleep(3)
    assert len(ckpt.committed_batches()) == settled, "the orphaned query still commits"
    assert "has not renewed its lease" in connect.server_log()
    from deltalake import DeltaTable

    rows = DeltaTable(str(work / "table")).to_pyarrow_table(columns=["id"]).num_rows
    assert rows > 0 and check_delta_table(str(work / "table"), rows).ok  # ids 0..rows-1, once each


def test_refusals_over_connect(connect, tmp_path):
    work, env, _ = _setup(tmp_path, 1000, 1000)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "onceflow", "run", "--no-standby", *args, str(work / "job.py")],
                              env=env, capture_output=True, text=True, timeout=120)

    r = run("--remote", connect.url, "--master", "local[2]")
    assert r.returncode == 2 and r.stderr.strip().endswith("a Spark Connect server has its own master; give one")
    r = run("--remote", "http://127.0.0.1:15002")
    assert r.returncode == 2 and "give a Spark Connect URL, e.g. sc://host:15002" in r.stderr
    r = run("--remote", f"sc://127.0.0.1:{free_port()}", "--restart-strategy", "none")
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode != 0 and len(lines) >= 1 and "cannot be reached" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not (work / "table").exists()

    # Spark 4.3's offline state repartition (--rescale) is a classic-session API.
    from pyspark.sql.connect.session import SparkSession as RemoteSession

    from onceflow.savepoint.manifest import SavepointError
    from onceflow.savepoint.restore import _repartition

    session = RemoteSession.builder.remote(connect.url).create()
    try:
        with pytest.raises(SavepointError, match="--rescale needs a classic Spark session"):
            _repartition(session, str(tmp_path / "ckpt"), 3)
    finally:
        session.stop()
