"""Faults of the driver process itself under ``onceflow run``: its Spark JVM killed alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from onceflow.checkpoint.eventlog import EventLog
from onceflow.verify.exactly_once import check_delta_table

JOB = """
import os
from onceflow import CheckpointConfig, DeltaSink, Job, fixed_delay
job = Job(
    name="jvm-kill",
    source=lambda spark: spark.readStream.format("onceflow-sequence")
        .option("total", int(os.environ["TOTAL"])).option("rows_per_second", 1000)
        .option("max_rows_per_batch", 1000).load(),
    sink=DeltaSink(os.environ["TABLE"]),
    checkpoint=CheckpointConfig(os.environ["CKPT"], interval="300 ms"),
    restart_strategy=fixed_delay(attempts=3, delay="1 s"),
    stop_when_idle=2.0,
)
"""


def _descendants(root: int) -> list[int]:
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
                parents[int(name)] = int(stat[stat.rindex(b")") + 2:].split()[1])
            except (OSError, ValueError):
                continue
    out, frontier = [], [root]
    while frontier:
        kids = [p for p, pp in parents.items() if pp in frontier]
        out += kids
        frontier = kids
    return out


def _spark_jvm(supervisor: int) -> int | None:
    for pid in _descendants(supervisor):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"org.apache.spark.deploy.SparkSubmit" in f.read():
                    return pid
        except OSError:
            continue
    return None


def _commits(ckpt) -> list[dict]:
    return [e for e in EventLog(str(ckpt)).read() if e["event"] == "sink_commit"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_driver_jvm_sigkilled_alone_restarts_the_process_and_commits_within_30s(tmp_path):
    """The OOM killer's choice: the JVM dies, the driver's Python process lives. The driver
    must exit as crashed at once (code 70); the supervisor promotes the warm standby, and the
    next batch commits within 30 s (a few seconds on an idle 2-core machine; the old driver
    retried forever); the table ends exactly-once. The JVM killed is the active driver's, never
    the standby's."""
    total = 60_000
    (tmp_path / "job.py").write_text(textwrap.dedent(JOB))
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "TABLE": str(tmp_path / "table"), "CKPT": str(ckpt), "TOTAL": str(total)}
    sup = subprocess.Popen([sys.executable, "-m", "onceflow", "run", str(tmp_path / "job.py")],
                           env=env, start_new_session=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 150
        events = EventLog(str(ckpt))
        while not any(e["event"] == "standby_ready" for e in events.read()) or len(_commits(ckpt)) < 3:
            assert time.time() < deadline and sup.poll() is None, "no commits, or the standby never got ready"
            time.sleep(0.2)
        active = [e["pid"] for e in events.read() if e["event"] == "process_start"][-1]
        jvm = _spark_jvm(active)
        assert jvm is not None, "no Spark JVM under the active driver"
        os.kill(jvm, signal.SIGKILL)
        killed = time.time()
        while not any(e["ts"] > killed for e in _commits(ckpt)):
            assert time.time() - killed < 30, "no batch committed within 30 s of the JVM's death"
            time.sleep(0.2)
        print(f"JVM SIGKILL -> next commit: {time.time() - killed:.1f} s")
        out, _ = sup.communicate(timeout=180)
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)
    assert sup.returncode == 0, out[-3000:]
    restarts = [e for e in EventLog(str(ckpt)).read() if e["event"] == "restart" and e.get("scope") == "process"]
    assert [e["cause"] for e in restarts] == ["exited with code 70"], restarts
    starts = [e for e in EventLog(str(ckpt)).read() if e["event"] == "process_start"]
    assert [bool(e.get("standby")) for e in starts] == [False, True], "the standby took over"
    report = check_delta_table(str(tmp_path / "table"), total)
    assert report.ok, report
