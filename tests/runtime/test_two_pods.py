"""Two ``onceflow run`` on one checkpoint, each the init of its own PID namespace, with one host
name: an overlapping rollout, or ``hostNetwork`` pods on one node. One runs; the other stands
by, says so, and takes over when the first pod dies. Neither fences the other. ``onceflow stop``
stops the job, not only the pod that runs it: a pod standing by exits too.

Before (issue 28.6): the second pod's driver watched the holder's record, saw it renew, was
refused ("already running", exit 5) and its supervisor ended with exit 5; an earlier version
(pid looked up in the wrong namespace) fenced the live driver in a loop. A promoted standby
took the lease *with takeover* whoever held it, so a supervisor whose own driver had never held
the lease fenced the other pod's live driver.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from onceflow.checkpoint.eventlog import EventLog
from onceflow.checkpoint.lease import DriverLease
from onceflow.runtime.restart import no_restart
from onceflow.runtime.supervisor import Supervisor

needs_namespaces = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None
    or subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--uts", "true"],
                      capture_output=True).returncode != 0,
    reason="needs root and unshare (PID and UTS namespaces)")

JOB = textwrap.dedent(
    """
    import os
    from onceflow import CheckpointConfig, DeltaSink, Job, fixed_delay

    def source(spark):
        return (spark.readStream.format("onceflow-sequence").option("total", 10**9)
                .option("rows_per_second", 400).option("max_rows_per_batch", 200).load())

    job = Job(name="pods", source=source, sink=DeltaSink(os.environ["WORK"] + "/table"),
              checkpoint=CheckpointConfig(os.environ["WORK"] + "/ckpt", interval="500 ms"),
              restart_strategy=fixed_delay(attempts=3, delay=1), master="local[1]",
              spark_conf={"spark.sql.shuffle.partitions": "1"})
    """
)

POD = ("import socket, sys, os; socket.sethostname('acc-pod'); "
       "os.execv(sys.executable, [sys.executable, '-m', 'onceflow', 'run', '--no-standby', sys.argv[1]])")


def _pod(work: Path, name: str) -> tuple[subprocess.Popen, Path]:
    """``onceflow run`` as pid 1 of a new PID + UTS namespace named acc-pod (a container)."""
    log = work / f"{name}.log"
    env = {**os.environ, "WORK": str(work), "ONCEFLOW_LEASE_TTL_S": "4", "ONCEFLOW_LEASE_RENEW_S": "1"}
    cmd = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--uts",
           sys.executable, "-c", POD, str(work / "job.py")]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True), log


def _commits(work: Path) -> list[dict]:
    return [e for e in EventLog(str(work / "ckpt")).read() if e["event"] == "sink_commit"]


def _epochs(work: Path) -> list[int]:
    return [e["lease_epoch"] for e in EventLog(str(work / "ckpt")).read() if e["event"] == "start"]


def _wait(cond, timeout: float, what: str, *alive: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        for p in alive:
            assert p.poll() is None, f"a pod exited ({p.returncode}) while waiting for {what}"
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@needs_namespaces
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_second_pod_with_the_same_host_name_stands_by_and_takes_over(tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    a, a_log = _pod(tmp_path, "pod-a")
    b = None
    try:
        _wait(lambda: len(_commits(tmp_path)) >= 3, 180, "pod A's first commits", a)
        b, b_log = _pod(tmp_path, "pod-b")
        _wait(lambda: "standing by" in b_log.read_text(), 120, "pod B to say it stands by", a, b)
        before = len(_commits(tmp_path))
        time.sleep(10)  # both pods up: A keeps its pace, B keeps waiting
        assert a.poll() is None and b.poll() is None, (a_log.read_text()[-2000:], b_log.read_text()[-2000:])
        assert len(_commits(tmp_path)) - before >= 4, "pod A's batches slowed down or stopped"
        assert _epochs(tmp_path) == [1], f"the lease changed hands while A lived: {_epochs(tmp_path)}"

        os.killpg(a.pid, signal.SIGKILL)  # pod A dies (its namespace's init with it)
        a.wait(timeout=30)
        killed_at = len(_commits(tmp_path))
        _wait(lambda: len(_commits(tmp_path)) >= killed_at + 3, 180, "pod B to take over and commit", b)
        assert _epochs(tmp_path)[-1] == 2 and b.poll() is None
        assert "standing by" in b_log.read_text() and "already running" not in b_log.read_text()

        # Pod A comes back and stands by; 'onceflow stop' stops the job: B stops, and A, which
        # never ran it, exits too (it does not take the job over, nor take a savepoint).
        a, a_log = _pod(tmp_path, "pod-a2")
        _wait(lambda: "standing by" in a_log.read_text(), 120, "the restarted pod A to stand by", a, b)
        stop = subprocess.run([sys.executable, "-m", "onceflow", "stop", str(tmp_path / "ckpt")],
                              capture_output=True, text=True, timeout=200)
        assert stop.returncode == 0, stop.stderr
        assert b.wait(timeout=120) == 0 and a.wait(timeout=120) == 0, (a_log.read_text()[-2000:],)
        assert _epochs(tmp_path)[-1] == 2, "the stopped job was started again by the standing-by pod"
        assert "stood by" in a_log.read_text() or "standing by for the lease" in a_log.read_text()
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)


def test_a_promoted_standby_takes_over_only_a_lease_of_its_own_supervisor(tmp_path):
    """The supervisor tells its standby to take over only a lease that one of its own drivers
    holds; a lease of a live driver it did not start (another pod's) is waited for."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    holder = textwrap.dedent(
        f"""
        from onceflow.checkpoint.lease import DriverLease
        lease = DriverLease({str(ckpt)!r}, "job").acquire()
        lease._stop.set()  # leave the record as a driver that died would
        """)
    sup = Supervisor("unused", no_restart(), str(ckpt), child_cmd=[sys.executable, "-c", holder])
    other = DriverLease(str(ckpt), "job").acquire()  # a live driver of another supervisor
    try:
        assert sup._takeover() is None
    finally:
        other.release()
    proc, _ = sup._start(1)  # a driver this supervisor started takes the lease and dies
    assert proc.wait(timeout=30) == 0
    top = DriverLease(str(ckpt), "job").top()
    assert top["pid"] == proc.pid
    assert sup._takeover() == top["epoch"]  # the go file names the dead driver's epoch
