"""Each driver's scratch space in a directory of its own, reclaimed once its owner is dead.

Before: Spark's ``blockmgr-*``/``spark-*`` directories and the JVM's temporary files of a
SIGKILLed driver stayed in the system temporary directory for good (nothing set a per-job
``spark.local.dir``, nothing cleaned up on restart). Then (issue 28.6 found it): a driver in
another PID namespace sharing the directory (a second pod) judged the owner by its pid in its
own namespace and removed a live driver's directory; that driver's next shuffle failed with
NoSuchFileException under ``blockmgr-*``."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from onceflow.process import start_time
from onceflow.runtime import scratch

DRIVER = textwrap.dedent("""
    import sys, time
    from types import SimpleNamespace
    from onceflow.checkpoint.config import CheckpointConfig
    from onceflow.runtime.runner import driver_spark
    job = SimpleNamespace(name="scratchy", master="local[2]", remote=None, spark_conf={},
                          checkpoint=CheckpointConfig(sys.argv[1]))
    spark = driver_spark(job, sys.argv[1])
    spark.range(1000).repartition(3).groupBy().count().collect()  # shuffle files: blockmgr-*
    open(sys.argv[2], "w").close()
    time.sleep(600)
""")


def test_a_killed_drivers_scratch_space_is_reclaimed_by_the_next_driver(tmp_path, monkeypatch):
    monkeypatch.setenv(scratch.ENV, str(tmp_path / "scratch"))
    ckpt, ready = str(tmp_path / "ckpt"), tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, ckpt, str(ready)], start_new_session=True,
                            env={**os.environ, "ONCEFLOW_JVM_CACHE": "0"})
    try:
        deadline = time.monotonic() + 240
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the driver did not start"
            time.sleep(0.2)
        job = scratch.job_dir("scratchy", ckpt)
        names = sorted(os.listdir(job))
        mine = names[0]
        assert mine.startswith(f"driver-{proc.pid}-{start_time(proc.pid)}-") and names == [mine, mine + ".lock"]
        assert any(n.startswith("blockmgr-") for n in os.listdir(os.path.join(job, mine)))
        assert scratch.reclaim(job) == []  # its owner lives: kept
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 30  # the JVM goes with its process group
    while scratch.reclaim(job) != [mine]:
        assert time.monotonic() < deadline, os.listdir(job)
        time.sleep(0.5)
    assert os.listdir(job) == []


def test_only_a_dead_owners_directory_is_reclaimed_whatever_its_pid(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    held = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, sys, time
        f = open({str(job / "driver-1-5-aa.lock")!r}, "ab")
        fcntl.flock(f, fcntl.LOCK_EX)
        print("locked", flush=True)
        time.sleep(600)""")], stdout=subprocess.PIPE, text=True)
    try:
        assert held.stdout.readline().strip() == "locked"
        for name in ("driver-1-5-aa", "driver-1-5-bb", "not-ours", "driver-9-9-cc"):
            (job / name).mkdir()
        (job / "driver-1-5-bb.lock").touch()  # its owner died: nobody holds the lock
        assert scratch.reclaim(str(job)) == ["driver-1-5-bb"]
        assert sorted(os.listdir(job)) == ["driver-1-5-aa", "driver-1-5-aa.lock", "driver-9-9-cc", "not-ours"]
    finally:
        held.kill()
        held.wait()  # its own child: reaped, so its files are closed
    assert scratch.reclaim(str(job)) == ["driver-1-5-aa"]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_a_live_driver_in_another_pid_namespace_keeps_its_directory(tmp_path, monkeypatch):
    """A driver that is pid 1 of its own namespace: pid 1 here is another process (init)."""
    monkeypatch.setenv(scratch.ENV, str(tmp_path / "scratch"))
    code = ("import sys, time; from onceflow.runtime import scratch; "
            "print(scratch.driver_dir('pods', 'ckpt'), flush=True); time.sleep(600)")
    pod = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", sys.executable, "-c", code],
                           stdout=subprocess.PIPE, text=True, env=os.environ.copy(), start_new_session=True)
    try:
        theirs = pod.stdout.readline().strip()
        assert os.path.basename(theirs).startswith("driver-1-"), theirs  # the init of its namespace
        mine = scratch.driver_dir("pods", "ckpt")
        assert os.path.isdir(theirs) and os.path.isdir(mine)
    finally:
        os.killpg(pod.pid, signal.SIGKILL)
        pod.wait()
    deadline = time.monotonic() + 30  # its lock goes once the kernel has closed its files
    while scratch.reclaim(scratch.job_dir("pods", "ckpt")) != [os.path.basename(theirs)]:
        assert time.monotonic() < deadline and os.path.isdir(theirs), "the dead pod's directory stays"
        time.sleep(0.2)


def test_local_masters_get_the_directory_and_the_users_settings_win():
    env: dict[str, str] = {}
    conf = scratch.spark_conf("/s/d", "local[2]", {"spark.driver.extraJavaOptions": "-Xss4m"}, env)
    assert conf == {"spark.driver.extraJavaOptions": "-Djava.io.tmpdir=/s/d -Xss4m"}
    assert env == {"SPARK_LOCAL_DIRS": "/s/d", "ONCEFLOW_SPARK_LOCAL_DIRS": "/s/d"}
    scratch.spark_conf("/s/e", "local[2]", {}, env)  # a later job of the process: its own
    assert env["SPARK_LOCAL_DIRS"] == "/s/e"
    for master, conf, given in (("spark://h:7077", {}, {}), ("local", {"spark.local.dir": "/m"}, {}),
                                ("local", {}, {"SPARK_LOCAL_DIRS": "/m"})):
        env = dict(given)
        scratch.spark_conf("/s/d", master, conf, env)
        assert env == given
