"""Fault injection (``onceflow.faults``): a pause stops the driver's process group once, so a
single SIGCONT to the group resumes it, from whichever thread of the driver it fired, and
that thread stops at the pause point even while the thread that takes the stop waits for a
CPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

CHILD = textwrap.dedent("""
    import os, sys, threading, time
    from onceflow.faults import maybe_crash

    def fire():
        maybe_crash("after_decide", 5, None, {"test_crash_at": "after_decide@5:pause",
                                              "test_crash_markers": sys.argv[1]})
        print("resumed", flush=True)
        os._exit(0)

    if sys.argv[2] == "thread":  # a py4j callback thread of the driver (foreachBatch)
        threading.Thread(target=fire).start()
        while True:
            time.sleep(0.05)
    fire()
""")


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _wait_paused(markers, pid: int, timeout: float = 30) -> float:
    """Wait until the pause at ``after_decide@5`` fired and ``pid`` is stopped; the deadline."""
    deadline = time.time() + timeout
    while not (markers / "fired-after_decide-5").exists() or _state(pid) != "T":
        assert time.time() < deadline, f"the pause never fired: {_state(pid)}"
        time.sleep(0.02)
    return deadline


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["main", "thread"])
def test_a_paused_driver_resumes_on_one_sigcont_to_its_group(tmp_path, where):
    # The driver is its own session leader (as `onceflow run` starts it), so its group is the
    # one paused. A driver that stopped twice (its group, then itself) ran its second stop only
    # after the first SIGCONT: a resumer signalling the group left it stopped for good.
    env = {k: v for k, v in os.environ.items() if k != "ONCEFLOW_DRIVER_PGID"}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), where], start_new_session=True,
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        _wait_paused(tmp_path, child.pid)
        time.sleep(0.5)
        assert _state(child.pid) == "T"  # paused, and it stays paused
        os.killpg(child.pid, signal.SIGCONT)
        try:
            out, _ = child.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"stopped again ({_state(child.pid)}) after one SIGCONT to its group")
        assert out.strip() == "resumed"
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()


BUSY_CHILD = textwrap.dedent("""
    import os, sys, threading, time
    from onceflow.faults import maybe_crash

    fired, busy = int(sys.argv[3]), int(sys.argv[4])
    go = threading.Event()

    def fire():
        os.sched_setaffinity(0, {fired})
        go.wait()
        maybe_crash("after_decide", 5, None, {"test_crash_at": "after_decide@5:pause",
                                              "test_crash_markers": sys.argv[1]})
        open(sys.argv[2], "w").write("a step after the pause point")
        time.sleep(600)

    threading.Thread(target=fire, daemon=True).start()
    # The main thread (the one the kernel hands a process's SIGSTOP to) waits for a busy CPU.
    os.sched_setaffinity(0, {busy})
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    go.set()
    while True:
        time.sleep(0.05)
""")


@pytest.mark.timeout(60)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_pause_stops_the_firing_thread_at_its_point_on_a_busy_machine(tmp_path):
    # The zombie conformance test once saw its driver "paused after the decision lookup"
    # decide and commit the batch first: the firing thread ran on while the main thread,
    # which takes the group's SIGSTOP and stops the others, waited 8 ms for a CPU.
    fired, busy = sorted(os.sched_getaffinity(0))[:2]
    hog = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{busy}}})\nwhile True: pass"])
    env = {k: v for k, v in os.environ.items() if k != "ONCEFLOW_DRIVER_PGID"}
    after = tmp_path / "after"
    child = subprocess.Popen([sys.executable, "-c", BUSY_CHILD, str(tmp_path), str(after), str(fired), str(busy)],
                             start_new_session=True, env=env)
    try:
        deadline = _wait_paused(tmp_path, child.pid)
        time.sleep(0.3)
        assert not after.exists(), "the thread that fired the pause ran past it before it stopped"
        os.killpg(child.pid, signal.SIGCONT)
        while not after.exists():
            assert time.time() < deadline, "not resumed by SIGCONT"
            time.sleep(0.02)
    finally:
        hog.kill()
        hog.wait()
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
