"""seeds/000 with Kafka in: Kafka -> transform -> PostgreSQL two_phase / Delta, under `onceflow run`.

Consecutive event ids are produced to a 3-partition topic (tansu) *while* the job runs; the
test SIGKILLs the driver's whole process group (driver, JVM, Python workers) at random moments
after each incarnation has committed data, and in the PostgreSQL case also SIGKILLs one
executor JVM of ``local-cluster[2,1,1024]``. Afterwards an independent reader checks that every
id is in the sink exactly once.

The source is configured with ``starting_offsets="latest"`` throughout. The next chunk of ids
is produced right after each kill, while no driver runs: a restart that honoured
``starting_offsets`` would skip that chunk (missing ids), one that re-read from an older
position would duplicate ids. Only "the checkpoint wins" passes.

tansu does not hide aborted transactions from read_committed consumers; the topic here is
written without transactions, so that does not matter for the source.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from kafka_broker import create_topic
from onceflow.checkpoint.eventlog import EventLog
from onceflow.verify.exactly_once import check_delta_table, check_ids
from pg_cluster import PgCluster

PARTITIONS = 3

JOB = """
import os
from onceflow import CheckpointConfig, DeltaSink, Job, KafkaSource, PostgresSink, fixed_delay


def source(spark):
    return KafkaSource(os.environ["BOOTSTRAP"], topics=os.environ["TOPIC"],
                       starting_offsets="latest", group_id=os.environ["GROUP"],
                       max_offsets_per_trigger=int(os.environ["PER_TRIGGER"])).load(spark)


def transform(df):  # sentinels (value -1) only close the log, see produce_ids
    return (df.selectExpr("CAST(CAST(value AS STRING) AS BIGINT) AS id",
                          "partition AS kafka_partition", "offset AS kafka_offset")
            .where("id >= 0"))


if os.environ["SINK"] == "postgres":
    sink = PostgresSink(os.environ["DSN"], os.environ["TABLE"], create_table=True)
else:
    sink = DeltaSink(os.environ["TABLE"])

job = Job(
    name="kafka-e2e", source=source, transform=transform, sink=sink,
    checkpoint=CheckpointConfig(os.environ["CKPT"], interval=0),
    restart_strategy=fixed_delay(attempts=5, delay=0.5),
    master=os.environ["MASTER"],
    spark_conf={"spark.task.maxFailures": "8"},
)
"""


@pytest.fixture(scope="module")
def pg() -> Iterator[PgCluster]:
    cluster = PgCluster(max_prepared_transactions=20, name="pg-kafka")
    yield cluster
    cluster.destroy()


def produce_ids(bootstrap: str, topic: str, ids: range) -> None:
    """Ids round-robin over the partitions (batched), each partition closed by a single-record
    batch: tansu reports the log end as base offset of the last batch + 1."""
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "enable.idempotence": True})
    for i in ids:
        while True:
            try:
                p.produce(topic, str(i).encode(), str(i).encode(), partition=i % PARTITIONS)
                break
            except BufferError:
                p.poll(0.05)
    assert p.flush(60) == 0
    close = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0, "batch.num.messages": 1})
    for part in range(PARTITIONS):
        close.produce(topic, b"-1", b"sentinel", partition=part)
    assert close.flush(30) == 0


def group_started(bootstrap: str, group: str, topic: str) -> bool:
    """The source commits its start offsets to ``group`` once it has planned from them: after
    that, records produced are after its initial 'latest' offsets."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        got = c.committed([TopicPartition(topic, p) for p in range(PARTITIONS)], timeout=5)
    finally:
        c.close()
    return all(tp.offset >= 0 for tp in got)


def executors_of(session: int) -> list[int]:
    """Executor JVMs (CoarseGrainedExecutorBackend) in the driver's session."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            if b"CoarseGrainedExecutorBackend" in cmd and os.getsid(int(entry)) == session:
                pids.append(int(entry))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return pids


class Run:
    """`onceflow run JOB` as a subprocess, watched through the checkpoint's event log."""

    def __init__(self, tmp: Path, env: dict[str, str]):
        self.tmp, self.ckpt = tmp, tmp / "ckpt"
        job = tmp / "job.py"
        job.write_text(textwrap.dedent(JOB))
        self.log_path = tmp / "supervisor.log"
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "onceflow", "run", str(job), "--no-standby"],
                                         env={**os.environ, **env, "CKPT": str(self.ckpt)},
                                         stdout=out, stderr=subprocess.STDOUT)
        self.log = EventLog(str(self.ckpt))

    def events(self, kind: str) -> list[dict]:
        return [e for e in self.log.read() if e["event"] == kind]

    def driver_pid(self) -> int | None:
        starts = self.events("process_start")
        return starts[-1]["pid"] if starts else None

    def wait(self, what: str, cond, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert self.proc.poll() is None, f"supervisor exited while waiting for {what}: {self.tail()}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {self.tail()}"
            time.sleep(0.2)

    def up(self, incarnation: int) -> bool:
        """Driver incarnation ``incarnation`` (1-based) runs and has committed new rows."""
        starts = self.events("process_start")
        return len(starts) == incarnation and any(
            c["ts"] > starts[-1]["ts"] and c["rows"] > 0 for c in self.events("sink_commit"))

    def planned_up_to(self, offsets: dict) -> bool:
        """A finished batch (committed to the sink) ended at ``offsets``."""
        return any(json.loads(o) == offsets for e in self.events("batch") for o in e["offsets"])

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def finish(self, timeout: float = 60) -> str:
        """SIGTERM ``onceflow run`` (stop after the in-flight batch) and expect exit code 0."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"the job did not finish: {self.tail()}") from None
        assert rc == 0, self.tail()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            pid = self.driver_pid()
            self.proc.kill()
            if pid:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait(30)


def run_with_kills(tmp: Path, bootstrap: str, env: dict[str, str], total: int, kills: int,
                   kill_executor: bool, seed: int) -> tuple[Run, str]:
    """Produce ``total`` ids in ``kills + 2`` chunks around the faults; return the finished run."""
    rng = random.Random(seed)
    topic, group = env["TOPIC"], env["GROUP"]
    create_topic(bootstrap, topic, PARTITIONS)
    bounds = [total * k // (kills + 2) for k in range(kills + 3)]
    chunks = [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    run = Run(tmp, env)
    try:
        run.wait("the query to plan its first batch", lambda: group_started(bootstrap, group, topic))
        produce_ids(bootstrap, topic, chunks[0])
        for k in range(kills):
            run.wait(f"incarnation {k + 1} to commit data", lambda k=k: run.up(k + 1))
            time.sleep(rng.uniform(0.2, 2.5))
            os.killpg(run.driver_pid(), signal.SIGKILL)  # driver, JVM, Python workers
            produce_ids(bootstrap, topic, chunks[k + 1])  # while no driver runs
        run.wait("the last incarnation to commit data", lambda: run.up(kills + 1))
        victims = executors_of(run.driver_pid()) if kill_executor else []
        assert len(victims) == (2 if kill_executor else 0), f"executors: {victims}"
        produce_ids(bootstrap, topic, chunks[-1])
        if victims:
            time.sleep(rng.uniform(0.2, 1.5))
            os.kill(victims[0], signal.SIGKILL)
        ends = log_end(bootstrap, topic)
        run.wait("every record to be committed", lambda: run.planned_up_to(ends), timeout=240)
        out = run.finish()
    finally:
        run.stop()
    restarts = run.events("restart")
    assert [r["cause"] for r in restarts if r["scope"] == "process"] == ["killed by SIGKILL"] * kills
    return run, out


def log_end(bootstrap: str, topic: str) -> dict[str, dict[str, int]]:
    """``{topic: {"0": end, ...}}``: Spark's Kafka offset shape at the current log end."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "wm"})
    try:
        return {topic: {str(p): c.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False)[1]
                        for p in range(PARTITIONS)}}
    finally:
        c.close()


def assert_checkpoint_at_log_end(run: Run, bootstrap: str, topic: str) -> None:
    """The newest ``offsets/N`` holds Spark's Kafka shape ``{"topic": {"0": n}}`` at the log end
    of every partition: everything produced (ids and sentinels) was planned, nothing beyond."""
    newest = max((n for n in os.listdir(run.ckpt / "offsets") if n.isdigit()), key=int)
    assert json.loads((run.ckpt / "offsets" / newest).read_text().splitlines()[-1]) == log_end(bootstrap, topic)


@pytest.mark.slow
def test_kafka_to_postgres_two_phase_driver_sigkills_and_executor_loss(kafka_broker, pg, tmp_path):
    total, kills = 60_000, 2
    tag = uuid.uuid4().hex[:8]
    env = {"BOOTSTRAP": kafka_broker, "TOPIC": f"e2e-pg-{tag}", "GROUP": f"lag-{tag}",
           "PER_TRIGGER": "10000", "SINK": "postgres", "DSN": pg.dsn, "TABLE": "kafka_events",
           "MASTER": "local-cluster[2,1,1024]"}
    run, out = run_with_kills(tmp_path, kafka_broker, env, total, kills, kill_executor=True, seed=4)
    assert "Lost executor" in out or "ExecutorLostFailure" in out, "the executor loss went unnoticed"
    with psycopg.connect(pg.dsn) as conn:
        ids = [r[0] for r in conn.execute("SELECT id FROM kafka_events")]
        dangling = conn.execute("SELECT gid FROM pg_prepared_xacts WHERE gid LIKE 'onceflow:%'").fetchall()
    report = check_ids(ids, total)
    assert report.ok, report
    assert dangling == []
    assert_checkpoint_at_log_end(run, kafka_broker, env["TOPIC"])


@pytest.mark.slow
def test_kafka_to_delta_driver_sigkills(kafka_broker, tmp_path):
    total, kills = 30_000, 1
    tag = uuid.uuid4().hex[:8]
    env = {"BOOTSTRAP": kafka_broker, "TOPIC": f"e2e-delta-{tag}", "GROUP": f"lag-{tag}",
           "PER_TRIGGER": "8000", "SINK": "delta", "TABLE": str(tmp_path / "table"), "MASTER": "local[2]"}
    run, _ = run_with_kills(tmp_path, kafka_broker, env, total, kills, kill_executor=False, seed=0)
    report = check_delta_table(str(tmp_path / "table"), total)
    assert report.ok, report
    assert_checkpoint_at_log_end(run, kafka_broker, env["TOPIC"])
