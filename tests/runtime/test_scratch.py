"""Each driver's scratch space in a directory of its own, reclaimed once its owner is dead.

Before: Spark's ``blockmgr-*``/``spark-*`` directories and the JVM's temporary files of a
SIGKILLed driver stayed in the system temporary directory for good (nothing set a per-job
``spark.local.dir``, nothing cleaned up on restart)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

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
        mine = f"driver-{proc.pid}-{start_time(proc.pid)}"
        assert os.listdir(job) == [mine]
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


def test_a_reused_pid_does_not_keep_a_dead_drivers_directory(tmp_path):
    job = tmp_path / "job"
    me = os.getpid()
    live, reused = f"driver-{me}-{start_time(me)}", f"driver-{me}-{start_time(me) - 100}"
    for name in (live, reused, "not-ours"):
        (job / name).mkdir(parents=True)
    assert scratch.reclaim(str(job)) == [reused]
    assert sorted(os.listdir(job)) == sorted([live, "not-ours"])


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
