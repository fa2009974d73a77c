"""Fault injection (``onceflow.faults``): a pause stops the driver's process group once, so a
single SIGCONT to the group resumes it, from whichever thread of the driver it fired."""

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
        deadline = time.time() + 30
        while not (tmp_path / "fired-after_decide-5").exists() or _state(child.pid) != "T":
            assert time.time() < deadline, f"the pause never fired: {_state(child.pid)}"
            time.sleep(0.05)
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
