"""``onceflow verify`` end to end: real drivers, JVMs, executors and PostgreSQL, really killed.

The CI-sized runs cover driver kill, JVM-only kill, zombie (a paused host whose successor on
another host name takes over), executor kill, PostgreSQL and broker restarts on two sinks, and must
give a clean verdict. The control run uses the Kafka sink's at-least-once mode with a crash in
the window where it duplicates, and the harness must fail it: the checker can fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from kafka_broker import KafkaBroker
from onceflow.verify.exactly_once import check_events
from onceflow.verify.spec import checksum, payload
from pg_cluster import OS_USER, PG_BIN, PgCluster
from verify_runs import run_verify

pytestmark = pytest.mark.slow


def _verify(tmp_path: Path, *args: str, env: dict | None = None, timeout: int = 400) -> tuple[int, dict, str]:
    return run_verify(tmp_path, "--seed", "7", *args, env=env, timeout=timeout)


def test_checker_counts_corrupted_payloads():
    ids = np.arange(10)
    payloads = [payload(int(i)) for i in ids]
    sums = [checksum(p) for p in payloads]
    payloads[3], sums[5] = payloads[4], sums[5] + 1  # another row's payload; a wrong checksum
    table = pa.table({"id": ids, "payload": payloads, "checksum": sums})
    r = check_events(table, 10)
    assert r.corrupted == 2 and r.sample_corrupted == [3, 5] and not r.ok


@pytest.mark.parametrize("sink, faults", [
    ("delta", ["driver_kill", "jvm_kill", "zombie"]),
    # the JVM write path: a JVM killed under its foreachBatch (the standby takeover after a
    # driver kill is the same runtime code as above; a zombie paused in the JVM path is the
    # conformance suite's zombie chain, test_zombie_drivers_are_fenced[delta-jvm])
    ("delta-jvm", ["jvm_kill"]),
], ids=["delta", "delta-jvm"])
def test_delta_survives_driver_kill_jvm_kill_and_a_zombie(tmp_path, sink, faults):
    # --any-time: each fault as soon as the job commits again (no wait for a warm standby);
    # downtime does not use up the stream (ids arrive at --rate while a driver runs), but a
    # zombie's successor runs while the old host is frozen: 40,000 ids once ran out after 2 faults
    rc, report, out = _verify(tmp_path, "--sink", sink, "--faults", ",".join(faults), "--count", str(len(faults)),
                              "--rate", "2000", "--events", str(20_000 * len(faults)), "--any-time")
    assert rc == 0, out[-3000:]
    assert report["verdict"] == "exactly-once" and report["duplicates"] == report["missing"] == 0
    kinds = sorted(f["kind"] for f in report["fault_log"])
    assert kinds == faults, out[-3000:]
    for zombie in (f for f in report["fault_log"] if f["kind"] == "zombie"):
        assert "successor committed" in zombie["detail"] and "zombie exit 5" in zombie["detail"]
    assert (tmp_path / "run" / "verify.png").stat().st_size > 10_000
    # the kills were taken over by the warm standby: promoted standbys started runners
    log = tmp_path / "run" / "checkpoint" / "_onceflow" / "events.jsonl"
    events = [json.loads(line) for line in log.read_text().splitlines()]
    promoted = {e["pid"] for e in events if e["event"] == "process_start" and e.get("standby")}
    kills = sum(kind.endswith("_kill") for kind in faults)
    assert len(promoted) >= kills and all(
        any(e["event"] == "start" and e["pid"] == pid and e["takeover"] for e in events) for pid in promoted)
    # the driver whose JVM alone was killed noticed and exited 70 (it did not hang)
    assert any(e["event"] == "restart" and e.get("exit_code") == 70 for e in events)


@pytest.fixture
def pg_verify():
    cluster = PgCluster(max_prepared_transactions=20, name="pgv")
    yield cluster
    cluster.destroy()


def test_kafka_to_postgres_survives_driver_and_executor_kills_and_restarts(tmp_path, pg_verify):
    """Kafka source -> PostgreSQL two_phase on local-cluster (executors in their own JVMs)."""
    ctl = f"runuser -u {OS_USER} -- {PG_BIN}/pg_ctl -D {pg_verify.data}"
    with KafkaBroker() as broker:
        rc, report, out = _verify(
            tmp_path, "--source", "kafka", "--kafka", broker.bootstrap,
            "--sink", "postgres-two_phase", "--postgres", pg_verify.dsn,
            "--master", "local-cluster[2,1,1024]", "--no-standby",
            "--faults", "driver_kill,executor_kill,pg_restart", "--count", "3", "--rate", "3000",
            "--events", "60000", "--pg-stop", f"{ctl} -m {{mode}} -w -t 60 stop",
            "--pg-start", f"{ctl} -l {pg_verify.logfile} -w -t 60 start",
        )
    assert rc == 0, out[-3000:]
    assert report["verdict"] == "exactly-once" and not report["dangling"]
    kinds = sorted(f["kind"] for f in report["fault_log"])
    assert kinds == ["driver_kill", "executor_kill", "pg_restart"], out[-3000:]


def test_kafka_to_postgres_survives_broker_restarts(tmp_path, pg_verify):
    """Kafka source -> PostgreSQL two_phase while the broker (tansu on S3 storage, so its log
    survives) is stopped, once with SIGTERM and once with SIGKILL, and started again."""
    with KafkaBroker(storage="s3") as broker:
        stop, start = broker.restart_commands
        rc, report, out = _verify(
            tmp_path, "--source", "kafka", "--kafka", broker.bootstrap, "--no-standby",
            "--sink", "postgres-two_phase", "--postgres", pg_verify.dsn, "--seed", "1",
            "--faults", "broker_restart", "--count", "2", "--rate", "3000", "--events", "45000",
            "--broker-stop", stop, "--broker-start", start,
        )
    assert rc == 0, out[-3000:]
    assert report["verdict"] == "exactly-once" and not report["dangling"]
    # seed 1: a graceful stop, then a SIGKILL
    details = [f"{f['kind']}: {f['detail']}" for f in report["fault_log"]]
    assert len(details) == 2 and "fast stop" in details[0] and "immediate stop" in details[1], details


def test_an_at_least_once_sink_is_caught(tmp_path):
    """A query that fails after the sink made batch 1 visible but before Spark recorded it: the
    at-least-once Kafka sink writes batch 1 again on the replay, and verify must report the
    duplicates."""
    with KafkaBroker() as broker:
        rc, report, out = _verify(
            tmp_path, "--sink", "kafka-at_least_once", "--kafka", broker.bootstrap, "--count", "0",
            "--rate", "3000", "--events", "12000", "--no-standby",
            env={"ONCEFLOW_CRASH_AT": "after_commit@1:raise", "ONCEFLOW_CRASH_MARKER_DIR": str(tmp_path)},
        )
    assert (tmp_path / "fired-after_commit-1").exists(), out[-3000:]
    assert rc == 1 and report["verdict"] == "FAILED", out[-3000:]
    assert report["duplicates"] > 0 and report["missing"] == 0


def test_a_run_that_could_not_inject_its_faults_is_inconclusive_not_failed(tmp_path):
    """The stream (2,000 events at 2,000/s) ends long before the first fault's pause (120-150 s):
    no fault is injected, the data is clean. Before: verdict FAILED, exit 1, like a lost event.
    verify stops as soon as the stream ends (before: it sat out the whole pause first)."""
    rc, report, out = _verify(tmp_path, "--count", "2", "--events", "2000", "--rate", "2000",
                              "--no-standby", "--gap", "120-150")
    assert rc == 3 and report["verdict"] == "INCONCLUSIVE", out[-3000:]
    assert report["wall_s"] < 100, report["wall_s"]
    assert report["faults"] == 0 and report["duplicates"] == report["missing"] == 0
    assert "only 0 of 2 faults were injected" in report["shortfall"] and not report["anomalies"]
    assert "INCONCLUSIVE: the data is clean" in out
