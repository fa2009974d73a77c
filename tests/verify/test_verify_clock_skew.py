"""``onceflow verify --faults clock_skew`` end to end: real drivers and JVMs on real libfaketime
clocks, a successor host in its own PID namespace and host name standing by for the lease.

The lease needs no shared clock: while one host's wall clock is 300 s off, the job keeps
committing and the successor never takes over. The stream (150 s at 1,000 events/s) leaves room
for two successors' Spark starts and skews (about 80 s on an idle machine).
"""

from __future__ import annotations

import re

import pytest

from onceflow.verify.clock import libfaketime
from verify_runs import run_verify

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _verify(tmp_path, *args: str) -> tuple[int, dict, str]:
    return run_verify(tmp_path, "--recovery-timeout", "600", "--no-standby", *args, timeout=1700)


@pytest.mark.skipif(libfaketime() is None, reason="libfaketime is not installed (apt-get install faketime)")
def test_the_lease_needs_no_shared_clock(tmp_path):
    """A successor host stands by (``--wait-for-lease``, its own PID namespace and host name) while one of the two
    hosts' clocks is 300 s off (seed 1: the job host's back, then the successor's forward); the job keeps
    committing, the successor never takes over, and no JVM spins under libfaketime."""
    rc, report, out = _verify(
        tmp_path, "--faults", "clock_skew", "--count", "2", "--rate", "1000", "--events", "150000",
        "--seed", "1", "--lease-ttl", "4", "--outage-s", "15")
    assert rc == 0, out[-3000:]
    assert report["verdict"] == "exactly-once" and report["duplicates"] == report["missing"] == 0
    details = [f["detail"] for f in report["fault_log"]]
    assert len(details) == 2, details
    pattern = (r"(job|successor) host clock ([+-]300)s for \d+s: (\d+) batch\(es\) committed meanwhile; "
               r"the successor stood by")
    found = [re.search(pattern, d) for d in details]
    assert all(m and int(m[3]) > 0 for m in found), details
    assert sorted((m[1], m[2]) for m in found) == [("job", "-300"), ("successor", "+300")], details
    # the successor (its own PID namespace: it cannot check the holder's pid) watched the
    # lease record, judged on its own monotonic clock, and never started a runner
    succ = (tmp_path / "run" / "successor-0.log").read_text(errors="replace")
    assert re.search(r"standing by: .*\(epoch \d+; it renews\)|which this host cannot check", succ), succ[-2000:]
