"""onceflow.process against real processes: stopped state, group, start time, and None once gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from onceflow.process import group_members, group_rss_mb, is_stopped, start_time


def test_a_stopped_child_then_a_reaped_one():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)
    try:
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10  # the child stops once it is next scheduled
        while not is_stopped(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert is_stopped(child.pid)
        assert not is_stopped(os.getpid())
        first = start_time(child.pid)
        assert first is not None and first == start_time(child.pid) > 0
        assert start_time(child.pid) == first  # stable for one process
        assert start_time(os.getpid()) != first
        assert group_members(child.pid) == [child.pid]
        assert group_rss_mb(os.getpgid(0)) >= 10  # this pytest process alone holds more
    finally:
        child.kill()
        child.wait()
    assert start_time(child.pid) is None and not is_stopped(child.pid)
    assert group_members(child.pid) == []
