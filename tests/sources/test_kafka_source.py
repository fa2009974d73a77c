"""The Kafka source against a real broker (tansu) and a real local Spark."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from kafka_broker import create_topic, delete_topic, produce
from onceflow.checkpoint.eventlog import EventLog
from onceflow.errors import ConfigError, SourceError
from onceflow.sources.kafka import (
    SCHEMA,
    KafkaSource,
    KafkaStreamReader,
    cap_offsets,
    parse_options,
)


def run_available_now(df, tmp: Path, name: str = "out"):
    """Run ``df`` to a parquet sink with Trigger.AvailableNow; return (rows, query)."""
    out, cp = tmp / name, tmp / f"{name}-cp"
    q = (df.writeStream.format("parquet").option("path", str(out))
         .option("checkpointLocation", str(cp)).trigger(availableNow=True).start())
    assert q.awaitTermination(120), "query did not finish"
    assert q.exception() is None, q.exception()
    spark = df.sparkSession
    rows = spark.read.parquet(str(out)).collect() if (out / "_spark_metadata").exists() else []
    return rows, q


def last_checkpoint_offsets(cp: Path) -> dict:
    """The source offsets Spark wrote in the newest ``offsets/N`` file of the checkpoint."""
    newest = max((cp / "offsets").iterdir(), key=lambda f: int(f.name) if f.name.isdigit() else -1)
    return json.loads(newest.read_text().strip().splitlines()[-1])


def test_reads_every_record_exactly_once_with_spark_kafka_schema(spark, kafka_broker, topic_name, tmp_path):
    create_topic(kafka_broker, topic_name, 3)
    produce(kafka_broker, topic_name, [f"v{i}" for i in range(90)], partitions=3,
            headers=[("h", b"x")])
    df = KafkaSource(kafka_broker, topics=topic_name, starting_offsets="earliest").load(spark)
    assert df.schema == SCHEMA
    rows, _ = run_available_now(df, tmp_path)
    assert sorted(r.value.decode() for r in rows) == sorted(f"v{i}" for i in range(90))
    assert {(r.partition, r.offset) for r in rows} == {(p, o) for p in range(3) for o in range(30)}
    r = rows[0]
    assert r.topic == topic_name and r.timestampType == 0 and r.timestamp is not None
    assert [(h.key, h.value) for h in r.headers] == [("h", b"x")]
    assert int(r.key) % 3 == r.partition  # key i was produced to partition i % 3
    assert last_checkpoint_offsets(tmp_path / "out-cp") == {topic_name: {"0": 30, "1": 30, "2": 30}}


def test_restart_continues_from_checkpoint_not_starting_offsets(spark, kafka_broker, topic_name, tmp_path):
    """seeds/004: stop, produce more, restart on the same checkpoint → only the new records,
    although startingOffsets=earliest would re-read everything. Group commits are lag-only."""
    create_topic(kafka_broker, topic_name, 3)
    produce(kafka_broker, topic_name, [f"a{i}" for i in range(30)], partitions=3)
    source = KafkaSource(kafka_broker, topics=[topic_name], starting_offsets="earliest",
                         group_id=f"lag-{topic_name}")
    first, _ = run_available_now(source.load(spark), tmp_path)
    assert len(first) == 30

    consumer = Consumer({"bootstrap.servers": kafka_broker, "group.id": f"lag-{topic_name}"})
    committed = consumer.committed([TopicPartition(topic_name, p) for p in range(3)], timeout=10)
    consumer.close()
    assert [tp.offset for tp in committed] == [10, 10, 10]

    produce(kafka_broker, topic_name, [f"b{i}" for i in range(12)], partitions=3)
    rows, _ = run_available_now(source.load(spark), tmp_path)
    new = sorted(r.value.decode() for r in rows if r.value.decode().startswith("b"))
    assert len(rows) == 42 and new == sorted(f"b{i}" for i in range(12))
    assert len({(r.partition, r.offset) for r in rows}) == 42
    assert last_checkpoint_offsets(tmp_path / "out-cp") == {topic_name: {str(p): 14 for p in range(3)}}


def test_initial_offsets_are_kept_in_the_checkpoint_for_a_replayed_batch_0(kafka_broker, topic_name, tmp_path):
    """A driver that dies during batch 0 leaves offsets/0 (the end) but not its start; Spark
    asks the source again. With the checkpoint known (onceflow Jobs pass it), the first answer
    is reused, so 'latest' does not move forward and skip records."""
    create_topic(kafka_broker, topic_name, 2)
    produce(kafka_broker, topic_name, ["a", "b"], partitions=2)
    s = parse_options({"kafka.bootstrap.servers": kafka_broker, "subscribe": topic_name,
                       "startingOffsets": "latest", "eventLog": str(tmp_path)})
    first = KafkaStreamReader(s, SCHEMA).initialOffset()
    assert first == {topic_name: {"0": 1, "1": 1}}
    produce(kafka_broker, topic_name, ["c", "d"], partitions=2)
    assert KafkaStreamReader(s, SCHEMA).initialOffset() == first  # a restarted driver
    unkept = dataclasses.replace(s, event_log=None)
    assert KafkaStreamReader(unkept, SCHEMA).initialOffset() == {topic_name: {"0": 2, "1": 2}}
    other = dataclasses.replace(s, starting="earliest")  # another source config: not reused
    assert KafkaStreamReader(other, SCHEMA).initialOffset() == {topic_name: {"0": 0, "1": 0}}
    assert KafkaStreamReader(s, SCHEMA).initialOffset() == first  # nor overwritten by it
    # A file torn by a crash mid-write (offsets/0 cannot exist yet then) counts as absent.
    kept = Path(KafkaStreamReader(s, SCHEMA)._initial_path())
    kept.write_text(kept.read_text()[:20])
    assert KafkaStreamReader(s, SCHEMA).initialOffset() == {topic_name: {"0": 2, "1": 2}}
    assert json.loads(kept.read_text())["offsets"] == {topic_name: {"0": 2, "1": 2}}
    assert sorted(p.name for p in kept.parent.iterdir() if p.name.startswith("kafka-")) == sorted(
        Path(KafkaStreamReader(c, SCHEMA)._initial_path()).name for c in (s, other))


def test_max_offsets_per_trigger_limits_each_batch(spark, kafka_broker, topic_name, tmp_path):
    create_topic(kafka_broker, topic_name, 3)
    # uneven partitions: 30 / 15 / 5 records
    produce(kafka_broker, topic_name, [f"x{i}" for i in range(30)], partition=0)
    produce(kafka_broker, topic_name, [f"y{i}" for i in range(15)], partition=1)
    produce(kafka_broker, topic_name, [f"z{i}" for i in range(5)], partition=2)
    df = KafkaSource(kafka_broker, topics=topic_name, starting_offsets="earliest",
                     max_offsets_per_trigger=20).load(spark)
    rows, q = run_available_now(df, tmp_path)
    sizes = [p.numInputRows for p in q.recentProgress if p.numInputRows]
    assert sizes == [20, 20, 10]
    first_end = json.loads(q.recentProgress[0].sources[0].endOffset)[topic_name]
    assert first_end == {"0": 12, "1": 6, "2": 2}  # 20 split 30:15:5
    assert len(rows) == 50 and len({(r.partition, r.offset) for r in rows}) == 50


def test_cap_offsets_is_proportional_bounded_and_progresses():
    a, b, c = ("t", 0), ("t", 1), ("t", 2)
    assert cap_offsets({a: 0, b: 0}, {a: 100, b: 100}, 1000) == {a: 100, b: 100}
    assert cap_offsets({a: 10, b: 0}, {a: 40, b: 10, c: 0}, 8) == {a: 16, b: 2, c: 0}
    one = cap_offsets({a: 0, b: 0, c: 0}, {a: 5, b: 5, c: 5}, 1)
    assert sum(one.values()) == 1  # never stalls, never exceeds the limit


def test_new_topic_matching_pattern_is_read_from_its_start(spark, kafka_broker, topic_name):
    """New partitions appear while running. tansu refuses CreatePartitions, so the new
    partitions come from a new topic matching subscribePattern (same code path). Batch 0's
    sink holds the query while the new topic is created and filled (Spark plans the next batch
    only after the running one finished), so the trigger that discovers it deterministically
    finds records already in it: a source that started new partitions at 'latest' would skip
    them."""
    create_topic(kafka_broker, f"{topic_name}-a", 2)
    produce(kafka_broker, f"{topic_name}-a", [f"a{i}" for i in range(10)], partitions=2)
    df = KafkaSource(kafka_broker, pattern=f"{topic_name}-.*", starting_offsets="earliest").load(spark)
    rows: list[tuple[int, str, int, int]] = []
    inside, release = threading.Event(), threading.Event()

    def sink(batch, batch_id: int) -> None:  # runs on the driver, in this process
        rows.extend((batch_id, r.value.decode(), r.partition, r.offset)
                    for r in batch.select("value", "partition", "offset").collect())
        if batch_id == 0:
            inside.set()
            release.wait(120)

    q = df.writeStream.foreachBatch(sink).trigger(processingTime="1 second").start()
    try:
        assert inside.wait(90), "batch 0 did not run"
        create_topic(kafka_broker, f"{topic_name}-b", 3)
        produce(kafka_broker, f"{topic_name}-b", [f"b{i}" for i in range(9)], partitions=3)
        release.set()
        deadline = time.monotonic() + 90
        while len(rows) < 19:
            assert time.monotonic() < deadline and q.isActive, f"only {len(rows)} of 19 records read"
            time.sleep(0.1)
        # The sink sees a batch's rows before Spark records that batch's progress: wait for it.
        while not any(f"{topic_name}-b" in (p.sources[0].endOffset or "") for p in q.recentProgress):
            assert time.monotonic() < deadline and q.isActive, "no progress names topic -b"
            time.sleep(0.1)
    finally:
        release.set()
        q.stop()
    assert q.exception() is None
    assert sorted(v for b, v, _, _ in rows if b == 0) == sorted(f"a{i}" for i in range(10))
    new = sorted((p, o) for b, v, p, o in rows if v.startswith("b"))
    assert new == [(p, o) for p in range(3) for o in range(3)]  # every record, from offset 0
    assert len(rows) == 19
    ends = [json.loads(p.sources[0].endOffset) for p in q.recentProgress]
    first_b = next(e[f"{topic_name}-b"] for e in ends if f"{topic_name}-b" in e)
    assert first_b == {"0": 3, "1": 3, "2": 3}, "topic -b was discovered before it was filled"


def test_transactional_records(spark, kafka_broker, topic_name, tmp_path):
    """Committed transactions are read; control records leave offset gaps that end a range."""
    create_topic(kafka_broker, topic_name, 1)
    produce(kafka_broker, topic_name, [f"c{i}" for i in range(5)], partition=0, transactional_id=topic_name)
    produce(kafka_broker, topic_name, [f"x{i}" for i in range(5)], partition=0,
            transactional_id=topic_name, abort=True)
    produce(kafka_broker, topic_name, ["d0", "d1"], partition=0, transactional_id=topic_name)
    df = KafkaSource(kafka_broker, topics=topic_name, starting_offsets="earliest").load(spark)
    rows, _ = run_available_now(df, tmp_path)
    got = {r.value.decode(): r.offset for r in rows}
    # Layout: c0..c4 at 0-4, commit marker 5, x0..x4 at 6-10, abort marker 11, d0 d1 at 12-13,
    # commit marker 14. The range ends at 15, after a control record: the reader must stop on
    # its position, not on a record.
    assert {k: v for k, v in got.items() if k[0] in "cd"} == {
        "c0": 0, "c1": 1, "c2": 2, "c3": 3, "c4": 4, "d0": 12, "d1": 13}
    assert last_checkpoint_offsets(tmp_path / "out-cp") == {topic_name: {"0": 15}}
    # Observed with tansu 0.6: read_committed does NOT hide aborted records, they are returned
    # (x0..x4 at 6-10). A real Kafka broker would drop them. If this fails, tansu changed.
    assert {k: v for k, v in got.items() if k[0] == "x"} == {f"x{i}": 6 + i for i in range(5)}


def test_recreated_topic_is_data_loss_unless_allowed(spark, kafka_broker, topic_name, tmp_path):
    create_topic(kafka_broker, topic_name, 1)
    produce(kafka_broker, topic_name, [f"old{i}" for i in range(10)], partition=0)
    source = KafkaSource(kafka_broker, topics=topic_name, starting_offsets="earliest")
    first, _ = run_available_now(source.load(spark), tmp_path)
    assert len(first) == 10
    delete_topic(kafka_broker, topic_name)
    create_topic(kafka_broker, topic_name, 1)
    produce(kafka_broker, topic_name, ["new0", "new1", "new2"], partition=0)

    with pytest.raises(Exception, match=rf"topic {topic_name} partition 0: the log now ends at offset 3"):
        run_available_now(source.load(spark), tmp_path)

    source.fail_on_data_loss = False
    source.event_log = str(tmp_path / "out-cp")  # what a onceflow Job sets automatically
    rows, _ = run_available_now(source.load(spark), tmp_path)
    assert sorted(r.value.decode() for r in rows) == sorted(
        [f"old{i}" for i in range(10)] + ["new0", "new1", "new2"])
    assert last_checkpoint_offsets(tmp_path / "out-cp") == {topic_name: {"0": 3}}
    # "log and count": the skipped range is in the event log, not only in a log line
    [loss] = [e for e in EventLog(str(tmp_path / "out-cp")).read() if e["event"] == "source_data_loss"]
    assert (loss["topic"], loss["partition"], loss["start"], loss["end"]) == (topic_name, 0, 10, 3)
    assert loss["cause"] == "log truncated or re-created"


def test_bad_inputs_fail_early_with_clear_messages(spark, kafka_broker, topic_name):
    create_topic(kafka_broker, topic_name, 2)
    with pytest.raises(SourceError, match=r"cannot reach Kafka at 127\.0\.0\.1:1 within 1s") as outage:
        KafkaSource("127.0.0.1:1", topics=topic_name, metadata_timeout_ms=1000).load(spark)
    assert not outage.value.fatal, "an unreachable broker is an outage: the restart strategy retries"
    with pytest.raises(ConfigError, match=r"topic\(s\) no-such-topic do not exist"):
        KafkaSource(kafka_broker, topics=["no-such-topic"]).load(spark)
    with pytest.raises(ConfigError, match="startingOffsets must be 'earliest', 'latest' or JSON"):
        KafkaSource(kafka_broker, topics=topic_name, starting_offsets="oldest").load(spark)
    with pytest.raises(ConfigError, match="invalid kafka.* option"):
        KafkaSource(kafka_broker, topics=topic_name, consumer_options={"no.such.prop": "1"}).load(spark)
    # Spark's own format() path: the same message, wrapped by Spark, at load()
    with pytest.raises(Exception, match=r"unknown option\(s\) bogus"):
        (spark.readStream.format("onceflow-kafka").option("kafka.bootstrap.servers", kafka_broker)
         .option("subscribe", topic_name).option("bogus", "1").load())


@pytest.mark.parametrize("options, message", [
    ({"subscribe": "t"}, "kafka.bootstrap.servers is required"),
    ({"kafka.bootstrap.servers": "h:1"}, "exactly one of subscribe"),
    ({"kafka.bootstrap.servers": "h:1", "subscribe": "t", "startingOffsets": '{"t":{"0":-3}}'},
     "startingOffsets must be"),
    ({"kafka.bootstrap.servers": "h:1", "subscribe": "t", "startingOffsets": '{"u":{"0":1}}'},
     "names topic"),
    ({"kafka.bootstrap.servers": "h:1", "subscribe": "t", "maxOffsetsPerTrigger": "0"}, "at least 1"),
    ({"kafka.bootstrap.servers": "h:1", "subscribe": "t", "failOnDataLoss": "maybe"}, "true or false"),
    ({"kafka.bootstrap.servers": "h:1", "subscribe": "t", "kafka.group.id": "g"}, "use groupId"),
])
def test_option_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        parse_options(options)


def test_options_parse_like_spark():
    s = parse_options({"kafka.bootstrap.servers": "h:1", "SUBSCRIBE": "a, b",
                       "startingOffsets": '{"a":{"0":23,"1":-2}}', "maxOffsetsPerTrigger": "7"})
    assert s.topics == ("a", "b") and s.starting == {"a": {"0": 23, "1": -2}}
    assert s.max_offsets_per_trigger == 7 and s.read_committed and s.fail_on_data_loss


def test_repr_never_prints_credentials():
    source = KafkaSource("b:9092", topics="t", consumer_options={"sasl.password": "s3cret", "client.id": "x"})
    assert "s3cret" not in repr(source) and "'sasl.password': '***'" in repr(source)
    assert "'client.id': 'x'" in repr(source)
