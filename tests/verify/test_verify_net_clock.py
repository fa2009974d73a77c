"""``onceflow verify``'s network and clock faults, end to end: real drivers and JVMs, a real
PostgreSQL behind verify's TCP fault proxy, real libfaketime clocks.

* net_partition: every connection of the job to PostgreSQL reset, new ones refused for longer
  than the sink's 10 s commit deadline and the lease TTL;
* lost_reply: commits (a transaction's COMMIT, COMMIT PREPARED) reach PostgreSQL and their
  answers are dropped with the connection;
* clock_skew: the job host's or a standing-by successor host's wall clock jumps by 300 s.

Each must end exactly-once, and its fault line must say what the fault really did (connections
cut and refused, the answers PostgreSQL gave that the job never saw, batches committed while
the clock was off and a successor that stood by). On a loaded 2-core machine a cold Spark start
alone took 150-500 s (load 20-68): each run gets a 600 s recovery timeout.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from onceflow.verify.clock import libfaketime
from pg_cluster import PgCluster

# a cold Spark start took 150-500 s at load 20-68 on the shared 2-core test machine (idle: ~20 s)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _verify(tmp_path: Path, *args: str) -> tuple[int, dict, str]:
    out = tmp_path / "report.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "onceflow", "verify", "--dir", str(tmp_path / "run"), "--json", str(out),
         "--gap", "1-2", "--recovery-timeout", "600", "--no-standby", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ),
    )
    try:
        output, _ = proc.communicate(timeout=1700)
    except subprocess.TimeoutExpired:
        proc.terminate()  # verify stops every process it started (SIGKILL would orphan them)
        output, _ = proc.communicate(timeout=120)
    report = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, report, output


@pytest.fixture
def pg():
    cluster = PgCluster(max_prepared_transactions=20, name="pgnet")
    yield cluster
    cluster.destroy()


def _supervisor_logs(tmp_path: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((tmp_path / "run").glob("supervisor-*.log")))


@pytest.mark.parametrize("mode", ["two_phase", "idempotent"])
def test_postgres_survives_a_partition_and_lost_commit_replies(tmp_path, pg, mode):
    rc, report, out = _verify(
        tmp_path, "--sink", f"postgres-{mode}", "--postgres", pg.dsn, "--seed", "7",
        "--faults", "net_partition,lost_reply", "--count", "2", "--rate", "2000", "--events", "60000",
        "--outage-s", "12")
    assert rc == 0, out[-3000:]
    assert report["verdict"] == "exactly-once" and report["duplicates"] == report["missing"] == 0
    assert not report["dangling"] and report["corrupted_payloads"] == 0
    faults = {f["kind"]: f["detail"] for f in report["fault_log"]}
    assert sorted(faults) == ["lost_reply", "net_partition"], out[-3000:]
    # the proxy really cut: live connections reset, and the job's reconnects refused
    cut = re.search(r"cut (\d+) connection\(s\), refused (\d+)", faults["net_partition"])
    assert cut and int(cut[1]) + int(cut[2]) > 0, faults
    # a commit (or PREPARE) reached PostgreSQL, which acted on it; the job only saw its connection die
    assert re.search(r"PostgreSQL answered (COMMIT|PREPARE TRANSACTION)", faults["lost_reply"]), faults
    logs = _supervisor_logs(tmp_path)
    assert "server closed the connection unexpectedly" in logs or "Connection refused" in logs, logs[-3000:]


@pytest.mark.skipif(libfaketime() is None, reason="libfaketime is not installed (apt-get install faketime)")
def test_the_lease_needs_no_shared_clock(tmp_path):
    """A successor host stands by (``--wait-for-lease``, its own PID namespace and host name) while one of the two
    hosts' clocks is 300 s off (seed 1: the job host's back, then the successor's forward); the job keeps
    committing, the successor never takes over, and no JVM spins under libfaketime."""
    rc, report, out = _verify(
        tmp_path, "--faults", "clock_skew", "--count", "2", "--rate", "1000", "--events", "300000",
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
