"""onceflow.procfs against real processes: state, parent, group, start time, and None once gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from onceflow.procfs import stat_fields
from onceflow.runtime.supervisor import group_members, process_start_time

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")


def test_stat_fields_of_a_stopped_child_then_of_a_reaped_one():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)
    try:
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10  # the child stops once it is next scheduled
        while (fields := stat_fields(child.pid)) and fields[0] != b"T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fields and fields[0] == b"T", fields
        assert int(fields[1]) == os.getpid() and int(fields[2]) == child.pid
        assert process_start_time(child.pid) == int(fields[19]) > 0
        assert group_members(child.pid) == [child.pid]
    finally:
        child.kill()
        child.wait()
    assert stat_fields(child.pid) is None and process_start_time(child.pid) is None


def test_a_command_name_with_spaces_and_parentheses_keeps_the_fields_in_place(tmp_path):
    odd = tmp_path / "we ird) (name"
    odd.symlink_to(sys.executable)
    child = subprocess.Popen([str(odd), "-c", "import time; time.sleep(60)"])
    try:
        fields = stat_fields(child.pid)
        assert fields is not None and int(fields[1]) == os.getpid()
    finally:
        child.kill()
        child.wait()
