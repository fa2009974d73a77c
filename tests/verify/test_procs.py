"""verify's process helpers against real processes."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from onceflow.verify import procs
from onceflow.verify.fault_base import can_unshare

HANDLES_TERM = ("import signal, sys, time\n"
                "signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))\n"
                "print('ready', flush=True)\n"
                "time.sleep(60)\n")


@pytest.mark.skipif(not can_unshare("--pid", "--fork", "--mount-proc"), reason="needs PID namespaces (root)")
def test_terminate_reaches_the_program_behind_an_unshare_fork_wrapper():
    """``unshare --fork`` ignores SIGTERM while it waits: a plain ``Popen.terminate()`` stopped
    nothing (verify's successor hosts and container restarts each waited out a 30 s timeout)."""
    cmd = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child=SIGTERM", sys.executable, "-c", HANDLES_TERM]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        started = time.monotonic()
        procs.terminate(p.pid)
        assert p.wait(10) == 3  # the program's own SIGTERM handler ran
        assert time.monotonic() - started < 5
    finally:
        procs.signal_all(procs.tree(p.pid), 9)
        p.wait(10)


def test_terminate_signals_a_plain_process_and_ignores_a_gone_one():
    p = subprocess.Popen([sys.executable, "-c", HANDLES_TERM], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    procs.terminate(p.pid)
    assert p.wait(10) == 3
    procs.terminate(p.pid)  # reaped: nothing to signal, no error


def test_python_workers_are_the_task_workers_forked_by_onceflows_daemon(spark):
    """worker_kill's targets on a local master: the workers forked by onceflow's daemon (the
    task workers), not only the planners' under Spark's daemon (before, the fault matched
    ``pyspark.daemon`` alone and so never hit a task's worker)."""
    import os

    def _pid(batches):  # nested: pickled by value
        import pyarrow as pa

        for _ in batches:
            yield pa.RecordBatch.from_pydict({"pid": [os.getpid()]})

    ran = {r.pid for r in spark.range(2, numPartitions=2).mapInArrow(_pid, "pid long").collect()}
    workers = {p.pid for p in procs.python_workers(os.getpid())}
    assert ran <= workers, (ran, [procs._cmdline(p) for p in procs.tree(os.getpid())])
