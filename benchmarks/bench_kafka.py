"""Kafka source throughput vs a raw confluent-kafka consumer, and Kafka -> Delta end to end.

One command: ``python benchmarks/bench_kafka.py [--records N] [--partitions P] [--repeat R]``.
Starts its own tansu broker (in-memory), produces N records to a P-partition topic and N/P
records to a 1-partition topic, then in the same run measures:

1. per partition: a raw confluent-kafka consumer reading the 1-partition topic vs
   KafkaSource -> ``format("noop")`` on the same topic (one Spark task): records/s and ratio;
2. whole topic: one raw consumer assigned all P partitions vs KafkaSource -> noop (local[2]);
3. Kafka -> Delta: KafkaSource -> ``CAST(value AS STRING)`` -> onceflow-delta, events/s.

Spark figures are wall time from ``start()`` to the end of a ``Trigger.AvailableNow`` query
(query start-up included; the sum of batch durations is printed too). Best of R runs after a
warm-up. tansu under-reports the log end of multi-record batches, so each partition ends with
one single-record batch (a sentinel) and all readers read exactly up to the log end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from confluent_kafka import Consumer, Producer, TopicPartition  # noqa: E402

from kafka_broker import KafkaBroker, create_topic  # noqa: E402
from onceflow.sources.kafka import KafkaSource  # noqa: E402
from onceflow.spark import get_spark  # noqa: E402


def fill(bootstrap: str, topic: str, partitions: int, records: int) -> int:
    """Produce ``records`` ~100-byte JSON values round-robin, then one sentinel per partition."""
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.size": 1_000_000,
                  "queue.buffering.max.messages": 1_000_000, "compression.type": "none"})
    pad = "x" * 64
    for i in range(records):
        while True:
            try:
                p.produce(topic, f'{{"id": {i}, "pad": "{pad}"}}'.encode(), str(i).encode(),
                          partition=i % partitions)
                break
            except BufferError:
                p.poll(0.05)
        if i % 10_000 == 0:
            p.poll(0)
    p.flush(120)
    single = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0, "batch.num.messages": 1})
    for part in range(partitions):
        single.produce(topic, b'{"id": -1}', b"sentinel", partition=part)
    single.flush(30)
    return records + partitions


def raw_consume(bootstrap: str, topic: str, partitions: int) -> tuple[int, float]:
    """Read every record of ``topic`` with one consumer; (records, seconds)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex[:6]}",
                  "enable.auto.commit": False, "isolation.level": "read_committed",
                  "fetch.max.bytes": 52_428_800, "max.partition.fetch.bytes": 10_485_760})
    tps = [TopicPartition(topic, p) for p in range(partitions)]
    ends = {tp.partition: c.get_watermark_offsets(tp, timeout=10, cached=False)[1] for tp in tps}
    n = 0
    start = time.perf_counter()
    c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    done: set[int] = set()
    while len(done) < partitions:
        msgs = c.consume(10_000, 1.0)
        for m in msgs:
            if m.error() is None:
                n += 1
                if m.offset() + 1 >= ends[m.partition()]:
                    done.add(m.partition())
    elapsed = time.perf_counter() - start
    c.close()
    return n, elapsed


def spark_run(spark, bootstrap: str, topic: str, fmt: str, root: str, transform=None, **opts):
    """KafkaSource -> ``fmt`` with Trigger.AvailableNow; (rows, wall seconds, sum of batch s)."""
    shutil.rmtree(root, ignore_errors=True)
    df = KafkaSource(bootstrap, topics=topic, starting_offsets="earliest").load(spark)
    if transform is not None:
        df = transform(df)
    w = df.writeStream.format(fmt).option("checkpointLocation", f"{root}/ckpt").trigger(availableNow=True)
    for k, v in opts.items():
        w = w.option(k, v)
    start = time.perf_counter()
    q = w.start()
    q.awaitTermination()
    wall = time.perf_counter() - start
    if q.exception() is not None:
        raise RuntimeError(str(q.exception()))
    rows = sum(p.numInputRows for p in q.recentProgress)
    batches = sum(p.durationMs.get("triggerExecution", 0) for p in q.recentProgress) / 1000
    return rows, wall, batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=900_000, help="records in the P-partition topic")
    ap.add_argument("--partitions", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    P = args.partitions
    tmp = tempfile.mkdtemp(prefix="onceflow-bench-kafka-")
    with KafkaBroker() as broker:
        bs = broker.bootstrap
        create_topic(bs, "bench", P)
        create_topic(bs, "bench1", 1)
        t0 = time.perf_counter()
        total = fill(bs, "bench", P, args.records)
        total1 = fill(bs, "bench1", 1, args.records // P)
        print(f"produced {total + total1:,} records in {time.perf_counter() - t0:.1f}s "
              f"(tansu {bs}, in-memory)", flush=True)
        spark = get_spark("local[2]", "bench-kafka")
        spark_run(spark, bs, "bench1", "noop", f"{tmp}/warm")  # Python workers, JIT, metadata
        best: dict[str, float] = {}
        extra: dict[str, str] = {}

        in_batches: dict[str, float] = {}

        def keep(name: str, rows: int, secs: float, batch_s: float | None = None) -> None:
            rate = rows / secs
            note = f"(batches only: {rows / batch_s:,.0f} rows/s)" if batch_s else ""
            print(f"  {name:44s} {rows:>10,} rows {secs:7.2f}s {rate:12,.0f} rows/s {note}", flush=True)
            if rate > best.get(name, 0):
                best[name], extra[name] = rate, note
            in_batches[name] = max(in_batches.get(name, 0), rows / batch_s if batch_s else rate)

        for r in range(args.repeat):
            print(f"run {r + 1}:")
            n, s = raw_consume(bs, "bench1", 1)
            keep("raw consumer, 1 partition", n, s)
            n, s, b = spark_run(spark, bs, "bench1", "noop", f"{tmp}/n1-{r}")
            keep("KafkaSource -> noop, 1 partition", n, s, b)
            n, s = raw_consume(bs, "bench", P)
            keep(f"raw consumer, {P} partitions", n, s)
            n, s, b = spark_run(spark, bs, "bench", "noop", f"{tmp}/nP-{r}")
            keep(f"KafkaSource -> noop, {P} partitions", n, s, b)
            n, s, b = spark_run(
                spark, bs, "bench", "onceflow-delta", f"{tmp}/d-{r}",
                transform=lambda df: df.selectExpr("CAST(value AS STRING) AS value", "partition", "offset"),
                path=f"{tmp}/d-{r}/table")
            keep("Kafka -> Delta end to end", n, s, b)
        spark.stop()
    shutil.rmtree(tmp, ignore_errors=True)
    one = best["KafkaSource -> noop, 1 partition"] / best["raw consumer, 1 partition"]
    many = best[f"KafkaSource -> noop, {P} partitions"] / best[f"raw consumer, {P} partitions"]
    print(f"\nbest of {args.repeat}, records={args.records:,}, partitions={P}, Spark local[2], 2 cores shared")
    for name, rate in best.items():
        print(f"  {name:44s} {rate:12,.0f} rows/s {extra[name]}")
    one_b = in_batches["KafkaSource -> noop, 1 partition"] / best["raw consumer, 1 partition"]
    many_b = in_batches[f"KafkaSource -> noop, {P} partitions"] / best[f"raw consumer, {P} partitions"]
    print(f"  ratio KafkaSource/raw per partition: {one:.2f}x wall, {one_b:.2f}x batch time (target >= 0.8x)")
    print(f"  ratio KafkaSource/raw whole topic:   {many:.2f}x wall, {many_b:.2f}x batch time")
    print(f"  Kafka -> Delta: {best['Kafka -> Delta end to end']:,.0f} events/s wall, "
          f"{in_batches['Kafka -> Delta end to end']:,.0f} batch time (target >= 150,000/s)")


if __name__ == "__main__":
    main()
