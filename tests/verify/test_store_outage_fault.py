"""verify's ``store_outage`` fault on a real tmpfs: a file held open for writing makes
``mount -o remount,ro`` fail with "mount point is busy". That is a fault to try again a moment
later, not an anomaly. Before: the run ended FAILED ("fault store_outage could not be
injected", the 2026-11-27 campaign's Delta lane) with its data clean."""

from __future__ import annotations

import os
import subprocess
import types

import pytest

from onceflow.verify.fault_base import FaultMissed
from onceflow.verify.faults import StoreOutage

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root only)")


@pytest.fixture
def tmpfs(tmp_path):
    mount = tmp_path / "fs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_busy_filesystem_is_a_missed_fault_and_a_free_one_goes_read_only_and_back(tmpfs):
    harness = types.SimpleNamespace(spec=types.SimpleNamespace(checkpoint=str(tmpfs / "checkpoint")),
                                    options=types.SimpleNamespace(outage_s=0.5))
    with open(tmpfs / "open-for-writing", "w") as f:
        f.write("x")
        with pytest.raises(FaultMissed, match="busy"):
            StoreOutage().inject(harness)  # type: ignore[arg-type]
    assert "read-only" in StoreOutage().inject(harness)  # type: ignore[arg-type]
    (tmpfs / "writable-again").write_text("y")  # and it was made writable again
