"""Kafka sink, probe, poison records and bad input against a real broker (tansu) and local Spark.

tansu (our only broker in tests) does not hide records of aborted transactions from
read_committed consumers. So: (a)/(b) assert that the probe sees exactly that and that
exactly_once refuses to start; (c) tests everything else with the probe bypassed
(``skip_broker_probe``) on paths where no transaction is ever aborted (the crash points fire
before a task's transaction begins or after it committed), so every record in the topic is a
committed one and counting all of them is honest.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator

import pytest
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from kafka_broker import KafkaBroker, create_topic, produce
from onceflow.checkpoint.eventlog import EventLog
from onceflow.errors import ConfigError, OnceflowError
from onceflow.job import CheckpointConfig, Job
from onceflow.runtime.restart import fixed_delay
from onceflow.sinks.delta import DeltaSink
from onceflow.sinks.kafka import MARKER_TOPIC, KafkaSink, _ensure_topic, close_all, doctor, probe
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
    mine = [json.loads(m.value()) for m in read_topic(kafka_broker, MARKER_TOPIC)
            if m.key() == f"kafka/{lineage}".encode()]
    parts = [m for m in mine if m["type"] == "partition"]
    decisions = {m["batch"]: m for m in mine if m["type"] == "decision"}
    batches = sorted(int(n) for n in os.listdir(tmp_path / "ckpt" / "commits") if n.isdigit())
    assert sorted(decisions) == batches
    assert len(parts) == len({(m["batch"], m["partition"]) for m in parts})  # no partition twice
    assert {h["partition"] for h in decisions[2]["handles"]} == {0, 1, 2}
    assert sum(m["rows"] for m in parts) == 1500
    assert all(len(d["fingerprint"]) == 32 for d in decisions.values())
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
    _ensure_topic(conf, MARKER_TOPIC, 15)
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
    _ensure_topic(conf, MARKER_TOPIC, 15)
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
    live.commit_transaction(10)  # not fenced by the check
    assert check._committed_after(manifest, job, str(tmp_path / "fork")) is None


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


# Kafka -> Delta / PostgreSQL through real driver SIGKILLs and an executor loss, with a
# restart after new input: tests/sources/test_kafka_end_to_end.py (it replaced an in-process
# ``after_decide:raise`` variant here; that crash window of the Delta sink is in test_delta.py).


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
    with pytest.raises(ConfigError, match="cannot reach Kafka at 127.0.0.1:1"):
        job.run(spark=spark)
    job.sink = KafkaSink(kafka_broker, "no-such-topic", mode="at_least_once")
    with pytest.raises(ConfigError, match="topic no-such-topic does not exist"):
        job.run(spark=spark)
    with pytest.raises(ConfigError, match="mode='exactly-once'"):
        KafkaSink(kafka_broker, "t", mode="exactly-once").data_source()  # type: ignore[arg-type]
