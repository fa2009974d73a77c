"""Exactly-once freshness: from an event's creation (and its broker acknowledgement) to its
visibility in PostgreSQL, onceflow's ``two_phase`` sink against a plain at-least-once job.

One command: ``python benchmarks/bench_freshness.py [--rate 5000] [--seconds 40] [--warmup 10]
[--partitions 2] [--interval 0]``.

Starts its own PostgreSQL (fsync on) and test broker (tansu). Then, one after the other and each
on a fresh topic and table:

- **onceflow**: a :class:`~onceflow.Job` (KafkaSource -> PostgresSink ``mode="two_phase"``,
  ``CheckpointConfig(interval=--interval)``) run in this process;
- **at-least-once**: the same source and parsing into ``foreachBatch``: the batch collected to
  the driver and COPYed into the table in one autocommit transaction (no fencing, no
  idempotency: what people write by hand).

During each, a producer thread sends ``--rate`` events per second for ``--seconds`` seconds,
each value ``id,created_ns``, and records when the broker acknowledged it (its delivery
callback); when the broker acknowledges slower than ``--rate``, the producer waits for room in
its queue (the ev/s column shows the rate reached). An independent watcher polls the table
every 20 ms (``SELECT id ... WHERE id >= smallest unseen``) and stamps each id when it first sees it. Events are produced once a warm-up
event is visible (the writer runs: no backlog at the start); events created in the first
``--warmup`` seconds are not counted (query start-up, first batches). Prints, per writer, the
p50/p99/max latency from creation and from the acknowledgement, and the throughput seen by the
watcher; the median of Spark's per-batch ``durationMs`` phases (where a batch's time goes); the
exactly-once p99 over the at-least-once p99 of the same run; and checks that every counted event
became visible (exactly once for onceflow).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kafka_broker import KafkaBroker, create_topic  # noqa: E402
from pg_cluster import PgCluster  # noqa: E402

PARSE = ("CAST(split(CAST(value AS STRING), ',')[0] AS BIGINT) AS id",
         "CAST(split(CAST(value AS STRING), ',')[1] AS BIGINT) AS created_ns")


def produce(bootstrap: str, topic: str, rate: int, seconds: float, acks: np.ndarray, created: np.ndarray,
            done: threading.Event) -> None:
    """``rate`` events per second, paced in 10 ms slices; ``acks[i]``: broker ack time (ns)."""
    from confluent_kafka import Producer

    # one record per producer batch: tansu reports the log end as the last batch's base offset + 1
    # idempotent: a retried send must not put an event twice in the topic
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0, "batch.num.messages": 1, "acks": "all",
                  "enable.idempotence": True})

    def acked(err, msg) -> None:
        if err is None:
            acks[int(msg.key())] = time.time_ns()

    start, sent, total = time.monotonic(), 0, len(acks) - 1  # the last id is the warm-up event
    while sent < total:
        due = min(total, int((time.monotonic() - start) * rate) + 1)
        while sent < due:
            created[sent] = time.time_ns()
            try:
                p.produce(topic, f"{sent},{created[sent]}".encode(), str(sent).encode(), on_delivery=acked)
            except BufferError:  # the broker acks slower than --rate: wait for room, the rate drops
                p.poll(0.05)
                continue
            sent += 1
        p.poll(0)
        time.sleep(0.01)
    while p.flush(10):
        pass
    done.set()


def warm_up(bootstrap: str, topic: str, warm_id: int) -> None:
    """One event outside the counted ids: the writer is ready once it is visible."""
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
    p.produce(topic, f"{warm_id},{time.time_ns()}".encode(), str(warm_id).encode())
    p.flush(30)


def watch(dsn: str, table: str, seen: np.ndarray, stop: threading.Event) -> None:
    """Stamp each id with the wall time (ns) the watcher first sees it; count repeats."""
    import psycopg

    low = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.is_set():
            try:
                rows = conn.execute(f"SELECT id FROM {table} WHERE id >= %s", (low,)).fetchall()
            except psycopg.errors.UndefinedTable:
                time.sleep(0.05)
                continue
            now = time.time_ns()
            for (i,) in rows:
                if 0 <= i < len(seen) and seen[i] == 0:
                    seen[i] = now
            while low < len(seen) and seen[low]:
                low += 1
            time.sleep(0.02)


def count_rows(dsn: str, table: str) -> tuple[int, int]:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(f"SELECT count(*), count(DISTINCT id) FROM {table}").fetchone()


def onceflow_job(spark, bootstrap: str, topic: str, dsn: str, table: str, ckpt: str, interval: float,
                 stop: threading.Event) -> None:
    from onceflow import CheckpointConfig, Job, KafkaSource, PostgresSink

    job = Job(name=f"fresh-{table}", source=KafkaSource(bootstrap, topics=topic, starting_offsets="earliest").load,
              transform=lambda df: df.selectExpr(*PARSE),
              sink=PostgresSink(dsn, table, mode="two_phase", create_table=True),
              checkpoint=CheckpointConfig(ckpt, interval=f"{interval} s"))
    job.run(spark=spark, stop=stop)


def at_least_once_job(spark, bootstrap: str, topic: str, dsn: str, table: str, ckpt: str, interval: float,
                      stop: threading.Event) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (id bigint, created_ns bigint)")

    def write(df, batch_id) -> None:
        rows = df.collect()
        with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor() as cur:
            with cur.copy(f"COPY {table} (id, created_ns) FROM STDIN") as copy:
                for r in rows:
                    copy.write_row((r[0], r[1]))

    from onceflow import KafkaSource

    df = KafkaSource(bootstrap, topics=topic, starting_offsets="earliest").load(spark).selectExpr(*PARSE)
    writer = df.writeStream.foreachBatch(write).option("checkpointLocation", ckpt)
    if interval > 0:
        writer = writer.trigger(processingTime=f"{int(interval * 1000)} milliseconds")
    q = writer.start()
    stop.wait()
    q.stop()


class Phases:
    """Spark's per-batch ``durationMs`` (a query listener), kept while ``on`` is set: where a
    micro-batch's time goes (triggerExecution = the whole batch; addBatch = the sink)."""

    def __init__(self, spark) -> None:
        from pyspark.sql.streaming import StreamingQueryListener

        self.on, self.batches = False, []
        outer = self

        class Listener(StreamingQueryListener):
            def onQueryStarted(self, event) -> None:
                pass

            def onQueryProgress(self, event) -> None:
                if outer.on and event.progress.numInputRows > 0:
                    outer.batches.append(dict(event.progress.durationMs))

            def onQueryIdle(self, event) -> None:
                pass

            def onQueryTerminated(self, event) -> None:
                pass

        spark.streams.addListener(Listener())

    def medians(self) -> dict[str, float]:
        keys = sorted({k for b in self.batches for k in b})
        return {k: float(np.median([b.get(k, 0) for b in self.batches])) for k in keys}


def measure(name: str, runner, spark, broker: KafkaBroker, pg: PgCluster, args, root: str,
            phases: Phases) -> dict:
    topic, table = f"fresh-{uuid.uuid4().hex[:6]}", f"fresh_{uuid.uuid4().hex[:6]}"
    create_topic(broker.bootstrap, topic, args.partitions)
    total = args.rate * args.seconds
    acks, created, seen = (np.zeros(total + 1, np.int64) for _ in range(3))
    produced, stop_job, stop_watch = threading.Event(), threading.Event(), threading.Event()
    job = threading.Thread(target=runner, args=(spark, broker.bootstrap, topic, pg.dsn, table, f"{root}/{table}",
                                                args.interval, stop_job), daemon=True)
    watcher = threading.Thread(target=watch, args=(pg.dsn, table, seen, stop_watch), daemon=True)
    job.start()
    watcher.start()
    warm_up(broker.bootstrap, topic, total)  # the writer runs before the first event: no backlog at t=0
    deadline = time.monotonic() + args.start_timeout
    while not seen[total] and time.monotonic() < deadline:
        time.sleep(0.1)
    if not seen[total]:
        raise SystemExit(f"{name}: the warm-up event was not visible after {args.start_timeout:g} s")
    time.sleep(2)
    threading.Thread(target=produce, args=(broker.bootstrap, topic, args.rate, args.seconds, acks, created,
                                           produced), daemon=True).start()
    time.sleep(args.warmup)
    phases.on, phases.batches = True, []
    produced.wait(args.seconds + 120)
    phases.on = False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not seen[:total].all():
        time.sleep(0.2)
    stop_watch.set()
    stop_job.set()
    job.join(120)
    watcher.join(10)
    rows, distinct = count_rows(pg.dsn, table)
    acks, created, seen = acks[:total], created[:total], seen[:total]
    first = int(created[0])
    counted = (created - first) >= args.warmup * 1e9
    ok = seen[counted] > 0
    from_created = (seen[counted][ok] - created[counted][ok]) / 1e6
    acked = ok & (acks[counted] > 0)
    from_ack = (seen[counted][acked] - acks[counted][acked]) / 1e6
    span = (seen[counted][ok].max() - seen[counted][ok].min()) / 1e9 if ok.any() else 0
    return {"writer": name, "events": int(counted.sum()), "missing": int((~ok).sum()), "rows": rows - 1,
            "duplicates": rows - distinct, "throughput": ok.sum() / span if span else 0.0,
            "created_ms": np.percentile(from_created, [50, 99, 100]) if ok.any() else [np.nan] * 3,
            "ack_ms": np.percentile(from_ack, [50, 99, 100]) if acked.any() else [np.nan] * 3,
            "batches": len(phases.batches), "phases": phases.medians()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=int, default=5000, help="events per second")
    ap.add_argument("--seconds", type=int, default=40, help="seconds of events per writer")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds of events not counted")
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--interval", type=float, default=0.0, help="trigger interval, seconds (0: back to back)")
    ap.add_argument("--start-timeout", type=float, default=180.0, help="seconds the writer may take to start")
    args = ap.parse_args()
    from onceflow.spark import get_spark

    root = tempfile.mkdtemp(prefix="bench-freshness-")
    pg = PgCluster(max_prepared_transactions=20, fsync=True, name="fresh")
    spark = get_spark("local[2]", "bench-freshness")
    try:
        with KafkaBroker() as broker:
            phases = Phases(spark)
            results = [measure("onceflow two_phase", onceflow_job, spark, broker, pg, args, root, phases),
                       measure("at-least-once foreachBatch+COPY", at_least_once_job, spark, broker, pg, args,
                               root, phases)]
    finally:
        spark.stop()
        pg.destroy()
    print(f"Kafka (tansu) -> PostgreSQL at {args.rate:,} events/s, {args.partitions} partitions, "
          f"interval {args.interval:g} s; {args.seconds} s of events per writer, the first {args.warmup:g} s not counted")
    print(f"{'writer':34} {'events':>8} {'missing':>7} {'dups':>5} {'ev/s':>7}  {'from creation p50/p99/max ms':>30}  "
          f"{'from broker ack p50/p99/max ms':>30}")
    for r in results:
        c, a = r["created_ms"], r["ack_ms"]
        print(f"{r['writer']:34} {r['events']:>8,} {r['missing']:>7} {r['duplicates']:>5} {r['throughput']:>7,.0f}  "
              f"{c[0]:>10,.0f}/{c[1]:>8,.0f}/{c[2]:>8,.0f}  {a[0]:>10,.0f}/{a[1]:>8,.0f}/{a[2]:>8,.0f}")
    print("median milliseconds per micro-batch with input (Spark's durationMs; triggerExecution is the whole batch):")
    for r in results:
        shown = ", ".join(f"{k} {v:,.0f}" for k, v in r["phases"].items() if v >= 1)
        print(f"  {r['writer']:34} {r['batches']:>4} batches: {shown}")
    eo, alo = results[0]["ack_ms"][1], results[1]["ack_ms"][1]
    print(f"exactly-once p99 / at-least-once p99 (from the ack): {eo / alo:.2f}x")
    sys.exit(0 if results[0]["missing"] == 0 and results[0]["duplicates"] == 0 else 1)


if __name__ == "__main__":
    main()
