"""Kafka sink, probe, poison records and bad input against a real broker (tansu) and local Spark.

tansu (our only broker in tests) does not hide records of aborted transactions from
read_committed consumers. So: (a)/(b) assert that the probe sees exactly that and that
exactly_once refuses to start; (c) tests everything else with the probe bypassed
(``skip_broker_probe``) on paths where no transaction is ever aborted (the crash points fire
before a task's transaction begins or after it committed), so every record in the topic is a
committed one and counting all of them is honest. The epoch tests (g) drive the data source
directly (no Spark): the fenced driver's writes are refused by the broker (PRODUCER_FENCED on
produce, which tansu implements) or never attempted, so no aborted record exists there
either; they read the marker topic with read_uncommitted, which would show one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pytest
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from pyspark.sql.types import StringType, StructField, StructType

from kafka_broker import KafkaBroker, create_topic, produce
from onceflow.checkpoint.eventlog import EventLog
from onceflow.errors import ConfigError, FencedError, OnceflowError, SinkError
from onceflow.job import CheckpointConfig, Job
from onceflow.runtime.restart import fixed_delay
from onceflow.sinks.base import Decision, TaskInfo
from onceflow.sinks.delta import DeltaSink
from onceflow.sinks.kafka import (
    MARKER_TOPIC,
    KafkaSink,
    KafkaSinkDataSource,
    _ensure_topic,
    close_all,
    doctor,
    ensure_marker_topic,
    probe,
)
from onceflow.sources.deadletter import decode_values, read_dead_letters
from onceflow.sources.kafka import KafkaSource
from onceflow.verify.exactly_once import check_delta_table, check_ids

# One record per producer batch: tansu under-reports the log end of multi-record batches.
ONE_PER_BATCH = {"batch.num.messages": 1, "linger.ms": 0}


@pytest.fixture(scope="module")
def kafka_broker() -> Iterator[str]:
    with KafkaBroker() as broker:
        yield broker.bootstrap
        close_all()  # this process's cached marker readers / driver producers


@pytest.fixture
def topic_name() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def read_topic(bootstrap: str, topic: str, partitions: int = 1) -> list:
    """Every record of ``topic`` (read_uncommitted: on tansu read_committed shows the same)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"v-{uuid.uuid4().hex[:6]}",
                  "enable.auto.commit": False, "isolation.level": "read_uncommitted"})
    ends = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False)[1]
            for p in range(partitions)}
    c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    out, deadline = [], time.monotonic() + 30
    while time.monotonic() < deadline:
        out += [m for m in c.consume(1000, 0.3) if m.error() is None]
        pos = {tp.partition: tp.offset for tp in c.position([TopicPartition(topic, p) for p in range(partitions)])}
        if all(ends[p] == 0 or pos[p] >= ends[p] for p in range(partitions)):
            break
    c.close()
    return out


def marker_records(bootstrap: str, lineage: str) -> list[tuple[str, dict]]:
    """(key, marker) of every record of ``lineage`` in the marker topic, read_uncommitted."""
    out = []
    for m in read_topic(bootstrap, MARKER_TOPIC):
        v = json.loads(m.value())
        if v.get("sink") == "kafka" and v.get("lineage") == lineage:
            out.append((m.key().decode(), v))
    return out


def seq_source(total: int, per_batch: int):
    def source(spark):
        return (spark.readStream.format("onceflow-sequence").option("total", total)
                .option("rows_per_second", 10_000_000).option("max_rows_per_batch", per_batch)
                .option("partitions", 3).load())
    return source


def as_record(df):
    return df.selectExpr("CAST(id AS STRING) AS key", "CAST(id AS STRING) AS value")


def kafka_job(tmp_path, bootstrap, topic, total, extra=None, per_batch=300, **sink_kw) -> Job:
    sink = KafkaSink(bootstrap, topic, producer_config=ONE_PER_BATCH, **sink_kw)
    opts = sink.options() | {"skip_broker_probe": "true"} | (extra or {})
    sink.options = lambda: opts  # type: ignore[method-assign]
    return Job(name="k", source=seq_source(total, per_batch), transform=as_record, sink=sink,
               checkpoint=CheckpointConfig(str(tmp_path / "ckpt"), interval=0),
               restart_strategy=fixed_delay(attempts=4, delay=0), stop_when_idle=1.0)


# ---- (a) (b) the probe and the refusal -------------------------------------------------------


def test_probe_reports_that_tansu_shows_aborted_records(kafka_broker):
    result = probe(kafka_broker, timeout=15)
    assert not result.ok
    assert "does not filter aborted transactions" in result.detail
    checks = {c.name: c for c in doctor(kafka_broker, timeout=15)}
    assert checks["reachable"].ok and not checks["aborted_records_hidden"].ok
    assert not checks["guarantee_exactly_once"].ok and "REFUSED" in checks["guarantee_exactly_once"].detail
    assert checks["guarantee_at_least_once"].ok

    from click.testing import CliRunner

    from onceflow.cli.main import main

    out = CliRunner().invoke(main, ["doctor", "--kafka", kafka_broker, "--timeout", "15"])
    assert out.exit_code == 1, out.output
    assert "does not filter aborted transactions" in out.output and "mode at_least_once" in out.output
    listing = CliRunner().invoke(main, ["doctor"])
    assert listing.exit_code == 0 and "onceflow-kafka-sink:" in listing.output
    assert "mode=exactly_once: exactly-once for read_committed consumers" in listing.output


def test_exactly_once_refuses_to_start_on_tansu(spark, kafka_broker, topic_name, tmp_path):
    create_topic(kafka_broker, topic_name, 1)
    job = kafka_job(tmp_path, kafka_broker, topic_name, 10)
    job.sink = KafkaSink(kafka_broker, topic_name)  # no bypass
    with pytest.raises(ConfigError, match=r"does not filter aborted transactions.*duplicates.*at_least_once"):
        job.run(spark=spark)
    assert read_topic(kafka_broker, topic_name) == []


# ---- (c) commit path, markers, replays, crash windows ------------------------------------------


def test_markers_replays_and_crash_windows(spark, kafka_broker, topic_name, tmp_path):
    """Three crash windows in one run (each fires once), then a restart on the same checkpoint."""
    create_topic(kafka_broker, topic_name, 2)
    markers = tmp_path / "markers"
    markers.mkdir()
    rules = "after_precommit@1:raise,before_decide@2:raise,after_commit@3:raise"
    kafka_job(tmp_path, kafka_broker, topic_name, 1500,
              extra={"test_crash_at": rules, "test_crash_markers": str(markers)}).run(spark=spark)
    assert len(os.listdir(markers)) == 3, "a fault never fired: the test would prove nothing"
    ids = [int(m.value()) for m in read_topic(kafka_broker, topic_name, 2)]
    report = check_ids(ids, 1500)
    assert report.ok, report

    # Markers: one per (batch, partition) and one decision per batch, with the fingerprint.
    lineage = json.loads((tmp_path / "ckpt" / "metadata").read_text())["id"]
    keyed = marker_records(kafka_broker, lineage)
    mine = [m for _, m in keyed]
    # One key per record (compaction keeps every one), all on the lineage's marker partition.
    assert len({k for k, _ in keyed}) == len(keyed)
    epochs = [m["epoch"] for m in mine if m["type"] == "epoch"]
    assert epochs == list(range(1, len(epochs) + 1)) and len(epochs) >= 2  # a restart took a new one
    parts = [m for m in mine if m["type"] == "partition"]
    decisions = {m["batch"]: m for m in mine if m["type"] == "decision"}
    batches = sorted(int(n) for n in os.listdir(tmp_path / "ckpt" / "commits") if n.isdigit())
    assert sorted(decisions) == batches
    assert len(parts) == len({(m["batch"], m["partition"]) for m in parts})  # no partition twice
    assert {h["partition"] for h in decisions[2]["handles"]} == {0, 1, 2}
    assert sum(m["rows"] for m in parts) == 1500
    assert all(len(d["fingerprint"]) == 32 for d in decisions.values())
    assert all(d["epoch"] in epochs for d in decisions.values())
    assert {h["reused"] for h in decisions[2]["handles"]} == {True}  # batch 2 replayed: all skipped
    events = list(EventLog(str(tmp_path / "ckpt")).read())
    assert any(e["event"] == "sink_commit" and e["batch"] == 3 and e["replay"] for e in events)

    # Restart on the same checkpoint with more input: continues, nothing re-written.
    kafka_job(tmp_path, kafka_broker, topic_name, 2100).run(spark=spark)
    report = check_ids([int(m.value()) for m in read_topic(kafka_broker, topic_name, 2)], 2100)
    assert report.ok, report


def test_open_transaction_of_a_dead_attempt_is_fenced_not_waited_for(spark, kafka_broker, topic_name, tmp_path):
    """A task that died between producing its marker and committing leaves a transaction open
    on the marker partition, and read_committed reads of that partition wait for it. Here two
    such transactions are left open with raw producers: one under partition 0's stable id (its
    retry fences it before reading any marker) and one of a partition this run never writes
    (fenced after a grace period). Before the fix every task attempt waited the whole sink
    timeout and failed, until the driver's recovery ran after a query restart."""
    create_topic(kafka_broker, topic_name, 1)
    lineage = f"L{uuid.uuid4().hex[:8]}"
    conf = {"bootstrap.servers": kafka_broker}
    ensure_marker_topic(conf, MARKER_TOPIC, 15)
    zombies = []
    for part in (0, 7):
        txn = f"onceflow-kafka-{lineage}-p{part}"
        p = Producer({**conf, "transactional.id": txn, "transaction.timeout.ms": 900_000})
        p.init_transactions(10)
        p.begin_transaction()
        # batch 10**6: never reached by this run. The aborted marker stays readable on tansu
        # (no aborted-record filtering), so it must not claim a batch this run writes.
        marker = {"type": "partition", "sink": "kafka", "lineage": lineage, "batch": 10**6,
                  "partition": part, "attempt": 0, "rows": 0, "fingerprint": "unknown", "txn": txn}
        p.produce(MARKER_TOPIC, json.dumps(marker).encode(), f"kafka/{lineage}".encode(), partition=0)
        assert p.flush(10) == 0
        zombies.append(p)
    started = time.monotonic()
    kafka_job(tmp_path, kafka_broker, topic_name, 300, extra={"lineage": lineage}, timeout=240).run(spark=spark)
    elapsed = time.monotonic() - started
    assert check_ids([int(m.value()) for m in read_topic(kafka_broker, topic_name)], 300).ok
    events = list(EventLog(str(tmp_path / "ckpt")).read())
    assert not [e for e in events if e["event"] == "restart"], "a task waited for the open transaction"
    assert elapsed < 200, f"took {elapsed:.0f}s: waited for the open transactions"
    for p in zombies:  # both were fenced: their commits fail
        with pytest.raises(KafkaException):
            p.commit_transaction(10)
    unverified = [e for e in events if e["event"] == "guarantee_unverified"]
    assert unverified and "NOT checked" in unverified[0]["detail"]  # skip_broker_probe is loud


def test_restore_check_never_fences_a_live_jobs_transaction(kafka_broker, tmp_path):
    """Forking a running job: the restore's roll back check reads the sink's decisions of the
    job's live lineage. Unlike the sink's own reads it must not fence that job's open
    transaction: it waits for it, fails with a clear error after the sink timeout, and the
    live transaction still commits."""
    from onceflow.errors import SinkError
    from onceflow.savepoint.manifest import Manifest
    from onceflow.savepoint.restore import RestoreRequest

    lineage = f"L{uuid.uuid4().hex[:8]}"
    conf = {"bootstrap.servers": kafka_broker}
    ensure_marker_topic(conf, MARKER_TOPIC, 15)
    txn = f"onceflow-kafka-{lineage}-p0"
    live = Producer({**conf, "transactional.id": txn, "transaction.timeout.ms": 900_000})
    live.init_transactions(10)
    live.begin_transaction()
    marker = {"type": "partition", "sink": "kafka", "lineage": lineage, "batch": 10**6,
              "partition": 0, "attempt": 0, "rows": 0, "fingerprint": "unknown", "txn": txn}
    live.produce(MARKER_TOPIC, json.dumps(marker).encode(), f"kafka/{lineage}".encode(), partition=0)
    assert live.flush(10) == 0
    manifest = Manifest("k", lineage, 3, [], [], None, None, "4", "0", 0.0, str(tmp_path / "gone"))
    job = Job(name="k", source=seq_source(1, 1), sink=KafkaSink(kafka_broker, "t", timeout=8),
              checkpoint=CheckpointConfig(str(tmp_path / "fork")))
    check = RestoreRequest("unused", fork=True)
    with pytest.raises(SinkError, match="an open transaction holds it"):
        check._committed_after(manifest, job, str(tmp_path / "fork"))
    before = dataclasses.replace(manifest, batch=10**6 - 1)  # the live transaction's batch is next
    with pytest.raises(SinkError, match="an open transaction holds it"):
        check._partly_visible(before, job, str(tmp_path / "fork"))
    live.commit_transaction(10)  # not fenced by the checks
    assert check._committed_after(manifest, job, str(tmp_path / "fork")) is None
    assert check._partly_visible(manifest, job, str(tmp_path / "fork")) is None
    partly = check._partly_visible(before, job, str(tmp_path / "fork"))
    assert partly is not None and (partly.batch, partly.partitions) == (10**6, {0: 0})


def test_at_least_once_is_explicit_and_works_on_tansu(spark, kafka_broker, topic_name, tmp_path):
    create_topic(kafka_broker, topic_name, 1)
    job = kafka_job(tmp_path, kafka_broker, topic_name, 200, mode="at_least_once")
    job.sink.options = lambda: KafkaSink(kafka_broker, topic_name, mode="at_least_once",  # no bypass
                                         producer_config=ONE_PER_BATCH).options()
    job.run(spark=spark)
    assert check_ids([int(m.value()) for m in read_topic(kafka_broker, topic_name)], 200).ok


# ---- (d) Kafka -> transform -> Delta, crash and restart ---------------------------------------


def kafka_to_delta(tmp_path, bootstrap, topic, extra=None, transform=None) -> Job:
    def source(spark):
        return KafkaSource(bootstrap, topics=topic, starting_offsets="earliest",
                           max_offsets_per_trigger=400).load(spark)

    sink = DeltaSink(str(tmp_path / "table"))
    if extra:
        opts = sink.options() | extra
        sink.options = lambda: opts  # type: ignore[method-assign]
    return Job(name="kd", source=source, sink=sink,
               transform=transform or (lambda df: df.selectExpr(
                   "CAST(CAST(value AS STRING) AS BIGINT) AS id", "partition", "offset")),
               checkpoint=CheckpointConfig(str(tmp_path / "ckpt"), interval=0),
               restart_strategy=fixed_delay(attempts=3, delay=0), stop_when_idle=1.5)


# Kafka -> PostgreSQL through a real driver SIGKILL, an executor loss and a database restart:
# tests/verify/test_verify_cli.py (the ``after_decide`` crash window of the Delta sink is in
# test_delta.py and the conformance suite).


# ---- (e) poison records ------------------------------------------------------------------------


def poison_job(tmp_path, bootstrap, topic, dead_letter):
    def decode_id(value: bytes) -> dict:  # nested: pickled by value for the Python workers
        import json

        return {"id": int(json.loads(value)["id"])}

    return kafka_to_delta(tmp_path, bootstrap, topic, transform=lambda df: decode_values(
        df, decode_id, "id long", dead_letter=dead_letter))


def test_poison_record_goes_to_dead_letter_or_fails_naming_it(spark, kafka_broker, topic_name, tmp_path):
    create_topic(kafka_broker, topic_name, 1)
    values = [json.dumps({"id": i}) for i in range(50)]
    values[17] = "{not json"
    produce(kafka_broker, topic_name, values, partition=0)

    with pytest.raises(OnceflowError, match=rf"poison record at topic {topic_name} partition 0 offset 17"):
        poison_job(tmp_path / "fail", kafka_broker, topic_name, None).run(spark=spark)
    assert check_delta_table(str(tmp_path / "fail" / "table"), 50).committed == 0

    dlq = str(tmp_path / "dlq")
    poison_job(tmp_path / "ok", kafka_broker, topic_name, dlq).run(spark=spark)
    report = check_delta_table(str(tmp_path / "ok" / "table"), 50)
    assert report.missing == 1 and report.sample_missing == [17] and report.duplicates == 0
    [bad] = read_dead_letters(dlq)
    assert (bad["topic"], bad["partition"], bad["offset"]) == (topic_name, 0, 17)
    assert "JSONDecodeError" in bad["error"]


# ---- (f) bad input -----------------------------------------------------------------------------


def test_bad_input_unreachable_and_unknown_topic(spark, kafka_broker, tmp_path):
    job = kafka_job(tmp_path, "127.0.0.1:1", "x", 10, timeout=3)
    job.sink = KafkaSink("127.0.0.1:1", "x", timeout=3)
    job.restart_strategy = fixed_delay(attempts=1, delay=0)  # an outage: restarted, then given up
    with pytest.raises(OnceflowError, match="cannot reach Kafka at 127.0.0.1:1") as info:
        job.run(spark=spark)
    assert not isinstance(info.value, ConfigError)
    job.sink = KafkaSink(kafka_broker, "no-such-topic", mode="at_least_once")
    with pytest.raises(ConfigError, match="topic no-such-topic does not exist"):
        job.run(spark=spark)
    with pytest.raises(ConfigError, match="mode='exactly-once'"):
        KafkaSink(kafka_broker, "t", mode="exactly-once").data_source()  # type: ignore[arg-type]


# ---- (g) epochs: fencing in the commit path, unreachable brokers, doctor -----------------------

SCHEMA = StructType([StructField("key", StringType()), StructField("value", StringType())])
HANDLES = [{"partition": 0, "attempt": 0, "rows": 1, "reused": False}]


def data_source(bootstrap: str, timeout: float = 20) -> KafkaSinkDataSource:
    return KafkaSink(bootstrap, "unused", producer_config=ONE_PER_BATCH, timeout=timeout).data_source()


def decisions_in_log(bootstrap: str, lineage: str, batch: int) -> list[dict]:
    return [m for _, m in marker_records(bootstrap, lineage) if m["type"] == "decision" and m["batch"] == batch]


def test_zombie_driver_cannot_decide_or_produce_after_a_successor_opened(kafka_broker):
    """Driver A opens (epoch e), driver B opens (e+1): A's decide raises FencedError and writes
    no decision marker, A's task stops before producing, B decides normally. Before epochs, A's
    decide simply appended its decision (and its task wrote its partition)."""
    lineage = f"L{uuid.uuid4().hex[:8]}"
    a, b = data_source(kafka_broker), data_source(kafka_broker)
    ea = a.open(lineage)
    eb = b.open(lineage)
    assert (a.epoch, b.epoch) == (ea, eb) and eb == ea + 1
    with pytest.raises(FencedError, match=rf"holds epoch {ea} of lineage {lineage}, but epoch {eb}"):
        a.decide(Decision(lineage, 0, "a" * 32, HANDLES, ea), SCHEMA, False)
    assert decisions_in_log(kafka_broker, lineage, 0) == []
    with pytest.raises(FencedError, match="task of batch 0 partition 0 refused"):
        a.pre_commit(TaskInfo(lineage, 0, 0, 0), SCHEMA, False, iter([]))
    assert not [m for _, m in marker_records(kafka_broker, lineage) if m["type"] == "partition"]

    mine = Decision(lineage, 0, "b" * 32, HANDLES, eb)
    b.decide(mine, SCHEMA, False)
    assert b.decision(lineage, 0) == mine and a.decision(lineage, 0) == mine
    assert [d["epoch"] for d in decisions_in_log(kafka_broker, lineage, 0)] == [eb]

    # Readers ignore decisions that appear after a higher epoch marker than their own (a
    # fenced driver's late write, or one without an epoch from an older onceflow).
    raw = Producer({"bootstrap.servers": kafka_broker})
    for epoch in (ea, None, eb):
        late = {"type": "decision", "sink": "kafka", "lineage": lineage, "batch": 7 if epoch != eb else 8,
                "fingerprint": "c" * 32, "handles": [], "epoch": epoch}
        key = f"kafka/{lineage}/d/{late['batch']}/{epoch}".encode()  # keyed as every marker is
        raw.produce(MARKER_TOPIC, json.dumps(late).encode(), key, partition=0)
    assert raw.flush(10) == 0
    assert b.decision(lineage, 7) is None and b.decision(lineage, 8).epoch == eb


def test_driver_fenced_between_its_check_and_its_write_writes_nothing(kafka_broker, monkeypatch):
    """B opens after A's decide read the markers but before A wrote: B's init_transactions
    fenced A's producer, so A's write is refused by the broker and A raises FencedError."""
    lineage = f"L{uuid.uuid4().hex[:8]}"
    a, b = data_source(kafka_broker), data_source(kafka_broker)
    ea = a.open(lineage)
    real, opened = KafkaSinkDataSource._decidable, []

    def b_opens_right_after_a_checked(self, decision, mine):
        out = real(self, decision, mine)
        if self is a and not opened:
            opened.append(b.open(lineage))
        return out

    monkeypatch.setattr(KafkaSinkDataSource, "_decidable", b_opens_right_after_a_checked)
    with pytest.raises(FencedError, match=rf"holds epoch {ea} .* but epoch {ea + 1}"):
        a.decide(Decision(lineage, 0, "a" * 32, HANDLES, ea), SCHEMA, False)
    assert opened == [ea + 1]
    assert decisions_in_log(kafka_broker, lineage, 0) == []
    b.decide(Decision(lineage, 0, "b" * 32, HANDLES, ea + 1), SCHEMA, False)
    assert b.decision(lineage, 0).fingerprint == "b" * 32


def test_rival_decision_for_a_decided_batch_is_refused(kafka_broker):
    """A retried decide of the same decision is a no-op; a different decision for a decided
    batch raises FencedError and is not written (before: appended silently, first one won)."""
    lineage = f"L{uuid.uuid4().hex[:8]}"
    ds = data_source(kafka_broker)
    epoch = ds.open(lineage)
    first = Decision(lineage, 3, "a" * 32, HANDLES, epoch)
    ds.decide(first, SCHEMA, False)
    ds.decide(Decision(lineage, 3, "a" * 32, list(HANDLES), epoch), SCHEMA, False)  # a retry
    rival = Decision(lineage, 3, "b" * 32, [{**HANDLES[0], "attempt": 1}], epoch)
    with pytest.raises(FencedError, match="batch 3 .* already decided differently"):
        ds.decide(rival, SCHEMA, False)
    assert decisions_in_log(kafka_broker, lineage, 3) == [
        {"type": "decision", "sink": "kafka", "lineage": lineage, "batch": 3, "fingerprint": "a" * 32,
         "handles": HANDLES, "epoch": epoch, "txn": f"onceflow-kafka-{lineage}-driver"}]
    assert ds.decision(lineage, 3) == first


def test_unreachable_broker_is_an_outage_with_a_one_line_message():
    """SinkError (restarted by the restart strategy), not ConfigError (fatal), from validate,
    open and doctor alike."""
    ds = KafkaSink("127.0.0.1:1", "x", timeout=2).data_source()
    for call in (lambda: ds.validate(SCHEMA, False), lambda: ds.open("L1")):
        with pytest.raises(SinkError) as info:
            call()
        message = str(info.value)
        assert not info.value.fatal and "\n" not in message
        assert message.startswith("onceflow-kafka-sink: cannot reach Kafka at 127.0.0.1:1 within 2s (")
    [check] = doctor("127.0.0.1:1", timeout=2)
    assert (check.name, check.ok) == ("reachable", False) and "cannot reach Kafka" in check.detail


def test_doctor_checks_transaction_timeout_and_marker_topic(kafka_broker):
    conf = {"bootstrap.servers": kafka_broker}
    ensure_marker_topic(conf, MARKER_TOPIC, 15)
    checks = {c.name: c for c in doctor(kafka_broker, timeout=15, transaction_timeout=120)}
    tt = checks["transaction_timeout"]
    assert tt.ok and "transaction_timeout=120s (transaction.timeout.ms=120000)" in tt.detail
    assert "does not report transaction.max.timeout.ms" in tt.detail  # tansu: reported, not failed
    mt = checks["marker_topic"]
    assert mt.ok and not mt.warning, mt.detail
    assert "replication 1" in mt.detail and "cleanup.policy=compact" in mt.detail
    assert "single-broker" in mt.detail

    # A marker topic that deletes markers by age fails the check.
    aged = f"m-{uuid.uuid4().hex[:8]}"
    _ensure_topic(conf, aged, 15, {"cleanup.policy": "delete", "retention.ms": "604800000"})
    [mt] = [c for c in doctor(kafka_broker, timeout=15, marker_topic=aged) if c.name == "marker_topic"]
    assert not mt.ok and "retention.ms=604800000" in mt.detail and "set cleanup.policy=compact" in mt.detail

    from click.testing import CliRunner

    from onceflow.cli.main import main

    out = CliRunner().invoke(main, ["doctor", "--kafka", kafka_broker, "--timeout", "15",
                                    "--transaction-timeout", "90"])
    assert "transaction_timeout: transaction_timeout=90s" in out.output, out.output
    assert f"marker_topic: {MARKER_TOPIC}: 1 partition(s), replication 1" in out.output


def test_partition_is_computed_before_its_transaction_begins(kafka_broker, topic_name, monkeypatch):
    """transaction_timeout bounds only the sending of rows: the task drains Spark's input (here
    a generator standing for a slow upstream) before it begins its transaction. tansu does not
    enforce transaction.timeout.ms, so the order is asserted rather than an abort. Before, the
    transaction was open while Spark computed the partition."""
    import pyarrow as pa

    from onceflow.sinks.kafka import producers

    create_topic(kafka_broker, topic_name, 1)
    events: list[str] = []
    real = producers.transactional_producer

    class Recording:
        def __init__(self, producer):
            self._producer = producer

        def begin_transaction(self):
            events.append("begin")
            return self._producer.begin_transaction()

        def __getattr__(self, name):
            return getattr(self._producer, name)

    monkeypatch.setattr(producers, "transactional_producer", lambda *a, **k: Recording(real(*a, **k)))

    def upstream():
        for i in range(3):
            events.append(f"batch{i}")
            yield pa.record_batch([pa.array([str(i)]), pa.array([str(i)])], names=["key", "value"])

    ds = KafkaSink(kafka_broker, topic_name, producer_config=ONE_PER_BATCH, timeout=20,
                   transaction_timeout=5).data_source()
    lineage = f"L{uuid.uuid4().hex[:8]}"
    ds.open(lineage)
    handle, rows = ds.pre_commit(TaskInfo(lineage, 0, 0, 0), SCHEMA, False, upstream())
    assert rows == 3 and events == ["batch0", "batch1", "batch2", "begin"]
    assert ds.conf["transaction.timeout.ms"] == 5000
    assert sorted(m.value() for m in read_topic(kafka_broker, topic_name)) == [b"0", b"1", b"2"]


def test_tasks_ending_their_transactions_at_once_never_wedge_the_marker_partition(topic_name):
    """tansu 0.6 wedges a partition for good when two transactions on it end at once (see
    onceflow/sinks/kafka/turns.py). With the probe skipped the sink's transaction ends take
    turns, so four tasks committing together, batch after batch, leave every batch decidable.
    Before the turns (or with ``serialize_commits=False``), 30 batches wedged the marker
    partition in 4 runs of 4 and a marker read failed with MarkerWait. Its own broker: a wedge
    is for good."""
    import pyarrow as pa

    with KafkaBroker() as broker:
        bootstrap = broker.bootstrap
        create_topic(bootstrap, topic_name, 2)
        ds = KafkaSink(bootstrap, topic_name, producer_config=ONE_PER_BATCH, timeout=8).data_source(
            {"skip_broker_probe": "true"})
        lineage = f"L{uuid.uuid4().hex[:8]}"
        epoch = ds.open(lineage)
        rows = [pa.record_batch([pa.array([str(i) for i in range(60)])] * 2, names=["key", "value"])]

        def task(batch: int, partition: int) -> dict:
            return ds.pre_commit(TaskInfo(lineage, batch, partition, 0), SCHEMA, False, iter(rows))[0]

        batches, tasks = 30, 4
        try:
            with ThreadPoolExecutor(tasks) as pool:
                for batch in range(batches):
                    handles = list(pool.map(task, [batch] * tasks, range(tasks)))
                    ds.decide(Decision(lineage, batch, "f" * 32, handles, epoch), SCHEMA, False)
        finally:
            log = broker.log_text(tail=None)
            close_all()
        assert "otherwise=" not in log, log[-3000:]
        assert len(read_topic(bootstrap, topic_name, 2)) == batches * tasks * 60


def test_a_lineage_whose_marker_partition_moved_is_refused_not_given_a_second_epoch_1(kafka_broker, tmp_path):
    """Partitions added to the marker topic move a lineage's markers to another partition of the
    routing hash. Before: the next driver found no epoch there, took epoch 1 again while a
    zombie with a higher epoch still passed its fence on the old partition, and tasks of drivers
    that disagreed on the count read different partitions. Now the driver refuses (the
    checkpoint committed batches, so the lineage must have markers), a task whose driver's epoch
    is missing refuses, and pinning the count the lineage started with finds them again."""
    import zlib

    from onceflow.errors import ConfigError

    markers = f"m-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_broker, markers, 3)
    lineage = next(lin for lin in (str(uuid.uuid4()) for _ in range(100))
                   if zlib.crc32(f"kafka/{lin}".encode()) % 3 != 0)
    ckpt = tmp_path / "ckpt"
    (ckpt / "commits").mkdir(parents=True)
    (ckpt / "metadata").write_text(json.dumps({"id": lineage}))
    (ckpt / "commits" / "0").write_text("v1\n{}")

    out = f"o-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_broker, out, 1)
    schema = StructType([StructField("key", StringType()), StructField("value", StringType())])

    def source(**kw) -> KafkaSinkDataSource:
        extra = {"checkpointlocation": str(ckpt), "skip_broker_probe": "true", **kw.pop("extra", {})}
        ds = KafkaSink(kafka_broker, out, marker_topic=markers, timeout=20, **kw).data_source(extra)
        ds.write_schema = schema
        return ds

    def write(ds: KafkaSinkDataSource, attempt: int):
        rows = pa.table({"key": ["1"], "value": ["1"]}).to_batches()
        return ds.pre_commit(TaskInfo(lineage, 0, 0, attempt), schema, False, iter(rows))

    assert source(marker_partitions=1).open(lineage) == 1  # started with a one-partition topic
    with pytest.raises(ConfigError, match="partition count changed since the lineage started"):
        source().open(lineage)
    with pytest.raises(ConfigError, match="a task of batch 0 holds epoch 1"):
        write(source(extra={"epoch": "1"}), 0)
    assert source(marker_partitions=1).open(lineage) == 2
    write(source(marker_partitions=1, extra={"epoch": "2"}), 1)
    assert [m.value() for m in read_topic(kafka_broker, out)] == [b"1"]


def test_a_new_reader_starts_at_the_lineages_recorded_start_and_keeps_only_recent_batches(kafka_broker, tmp_path,
                                                                                          monkeypatch):
    """Issue 28.11: every new process read the whole marker partition (all lineages, all
    batches since the topic was created) and kept all of it in memory. Now the driver records
    the lineage's start in the checkpoint after its decisions; a new reader starts there, skips
    other lineages by key, still sees the epochs taken before it, and forgets settled batches."""
    from onceflow.sinks.kafka.markers import KEEP_BATCHES

    markers = f"m-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_broker, markers, 1)
    lineage, ckpt = str(uuid.uuid4()), tmp_path / "ckpt"
    ckpt.mkdir()

    def source() -> KafkaSinkDataSource:
        return KafkaSink(kafka_broker, "unused", marker_topic=markers, timeout=20, marker_start_step=0,
                         producer_config=ONE_PER_BATCH).data_source({"checkpointlocation": str(ckpt)})

    raw = Producer({"bootstrap.servers": kafka_broker, **ONE_PER_BATCH})

    def others(n: int) -> None:  # markers of other lineages, as other jobs write them
        for i in range(n):
            other = f"other-{i % 7}"
            m = {"type": "decision", "sink": "kafka", "lineage": other, "batch": i, "fingerprint": "f",
                 "handles": [], "epoch": 1}
            raw.produce(markers, json.dumps(m).encode(), f"kafka/{other}/d/{i}/1".encode(), partition=0)
        assert raw.flush(30) == 0

    others(300)
    driver = source()
    epoch = driver.open(lineage)
    for batch in range(40):
        others(20)
        decision = Decision(lineage, batch, f"{batch:032d}", HANDLES, epoch)
        driver.decide(decision, SCHEMA, False)
        driver.commit(decision)
    mine = driver._markers(lineage)
    kept = sorted(k[2] for k in mine.decisions)  # settled batches forgotten (checked at each read)
    assert kept[-1] >= 38 and len(kept) <= KEEP_BATCHES + 2, kept  # (39's marker: read at the next read)
    assert mine.is_settled(0) and not mine.is_settled(40)  # forgotten, still known decided
    start_file = ckpt / "_onceflow" / "sink-cache" / "kafka-markers-kafka.json"
    recorded = json.loads(start_file.read_text())
    assert (recorded["lineage"], recorded["batch"], recorded["epoch"]) == (lineage, 39, epoch)
    total = 300 + 40 * 20 + 1 + 40  # others, the epoch marker, the decisions

    close_all()  # a new process: a driver after a restart, or a new Python worker
    fresh = source()
    assert fresh.decision(lineage, 39).fingerprint == f"{39:032d}" and fresh.decision(lineage, 40) is None
    reader = fresh._markers(lineage)
    assert reader.start == recorded["start"] > 0
    assert reader.records_read <= 25 and reader.records_kept <= 2, (reader.records_read, total)
    # A late task attempt of batch 5 (its executor woke after the job moved on): its markers lie
    # before the start, yet it must find the batch decided and write nothing.
    monkeypatch.setattr(TaskInfo, "current", classmethod(lambda cls: TaskInfo(lineage, 5, 0, 1)))
    assert source().is_decided(lineage, 5) and not reader.is_settled(40)
    successor = source()
    assert successor.open(lineage) == epoch + 1  # the epoch taken before the start still counts
    with pytest.raises(FencedError):  # and the old driver is fenced as before
        driver.decide(Decision(lineage, 40, "z" * 32, HANDLES, epoch), SCHEMA, False)

    close_all()
    start_file.unlink()  # no start recorded: read it all
    whole = source()
    whole.decision(lineage, 39)
    assert whole._markers(lineage).records_read >= total
