"""Exactly-once freshness: from an event's creation (and its broker acknowledgement) to its
visibility in PostgreSQL and in Delta Lake, onceflow's sinks against plain at-least-once jobs.

One command: ``python benchmarks/bench_freshness.py [--sinks postgres,delta] [--rate 5000]
[--seconds 40] [--warmup 10] [--partitions 2] [--interval 0] [--linger-ms 5]``.

Starts its own PostgreSQL (fsync on) and test broker (tansu). Then, one after the other and each
on a fresh topic and table, per sink:

- **onceflow**: a :class:`~onceflow.Job` (KafkaSource -> ``PostgresSink(mode="two_phase")`` or
  ``DeltaSink(path)``, ``CheckpointConfig(interval=--interval)``) run in this process;
- **at-least-once**: the same source and parsing into ``foreachBatch``: PostgreSQL, the batch
  collected to the driver and COPYed into the table in one autocommit transaction; Delta, the
  batch appended with ``deltalake.write_deltalake`` (no fencing, no idempotency: what people
  write by hand).

During each, a producer thread sends ``--rate`` events per second for ``--seconds`` seconds,
each value ``id,created_ns``, and records when the broker acknowledged it (its delivery
callback); it batches as librdkafka does by default (``--linger-ms 5``). With one record per
request (``--linger-ms 0``) the test broker, beside Spark on 2 cores, acknowledged only about
830 events/s and slowed every batch's fetches (p99 about 2.5 s for both writers): the broker's
limit, not the writers'. When the broker acknowledges slower than ``--rate``, the producer waits
for room in its queue (the ev/s column shows the rate reached). An independent watcher stamps
each id when it first sees it: every 20 ms it polls the table (PostgreSQL: ``SELECT id ... WHERE
id >= smallest unseen``; Delta: delta-rs reads the new log entries and the watcher the ids of
the new files). Events are produced once a warm-up event is visible (the writer runs: no
backlog at the start); events created in the first ``--warmup`` seconds are not counted (query
start-up, first batches). Prints, per writer, the p50/p99/max latency from creation and from
the acknowledgement, and the throughput seen by the watcher; the median of Spark's per-batch
``durationMs`` phases (where a batch's time goes); per sink, the exactly-once p99 over the
at-least-once p99 of the same run; and checks that every counted event became visible
(exactly once for onceflow).
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
            done: threading.Event, linger_ms: float, partitions: int) -> None:
    """``rate`` events per second, paced in 10 ms slices; ``acks[i]``: broker ack time (ns).

    The producer batches as librdkafka does by default (``linger_ms``; 0: one record per
    request). tansu reports a partition's end as its last record batch's base offset + 1, so the
    rest of a batch becomes readable when the next batch lands (``linger_ms`` later at a steady
    rate); after the last event, one sentinel record per partition, each alone in its batch
    (ids below 0, not counted), makes the end exact."""
    from confluent_kafka import Producer

    # idempotent: a retried send must not put an event twice in the topic
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": linger_ms, "acks": "all", "enable.idempotence": True,
                  **({"batch.num.messages": 1} if linger_ms == 0 else {})})

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
    for part in range(partitions):
        p.produce(topic, f"{-1 - part},0".encode(), b"-1", partition=part)
        p.flush(10)
    done.set()


def warm_up(bootstrap: str, topic: str, warm_id: int) -> None:
    """One event outside the counted ids: the writer is ready once it is visible."""
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
    p.produce(topic, f"{warm_id},{time.time_ns()}".encode(), str(warm_id).encode())
    p.flush(30)


def watch_pg(dsn: str, table: str, seen: np.ndarray, stop: threading.Event) -> None:
    """Stamp each id with the wall time (ns) the watcher first sees it in the table."""
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


def count_pg(dsn: str, table: str) -> tuple[int, int]:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(f"SELECT count(*), count(DISTINCT id) FROM {table}").fetchone()


def watch_delta(root: str, table: str, seen: np.ndarray, stop: threading.Event) -> None:
    """Stamp each id with the wall time (ns) the watcher first sees it in a committed version of
    the Delta table (delta-rs reads each new log entry; the new files' ids are read once)."""
    import pyarrow.parquet as pq
    from deltalake import DeltaTable

    path, dt, known = f"{root}/{table}", None, set()
    while not stop.is_set():
        try:
            if dt is None:
                dt = DeltaTable(path)
            else:
                dt.update_incremental()
        except Exception:  # noqa: BLE001 - no table yet
            time.sleep(0.05)
            continue
        now = time.time_ns()
        for f in set(dt.file_uris()) - known:
            known.add(f)
            ids = pq.read_table(f, columns=["id"]).column("id").to_numpy()
            ids = ids[(ids >= 0) & (ids < len(seen))]
            fresh = ids[seen[ids] == 0]
            seen[fresh] = now
        time.sleep(0.02)


def count_delta(root: str, table: str) -> tuple[int, int]:
    from deltalake import DeltaTable

    ids = DeltaTable(f"{root}/{table}").to_pyarrow_table(columns=["id"]).column("id").to_numpy()
    return len(ids), len(np.unique(ids))


def _job(spark, bootstrap: str, topic: str, table: str, ckpt: str, interval: float, stop: threading.Event,
         sink) -> None:
    from onceflow import CheckpointConfig, Job, KafkaSource

    Job(name=f"fresh-{table}", source=KafkaSource(bootstrap, topics=topic, starting_offsets="earliest").load,
        transform=lambda df: df.selectExpr(*PARSE), sink=sink,
        checkpoint=CheckpointConfig(ckpt, interval=f"{interval} s")).run(spark=spark, stop=stop)


def _foreach_batch(spark, bootstrap: str, topic: str, ckpt: str, interval: float, stop: threading.Event,
                   write) -> None:
    from onceflow import KafkaSource

    df = KafkaSource(bootstrap, topics=topic, starting_offsets="earliest").load(spark).selectExpr(*PARSE)
    writer = df.writeStream.foreachBatch(write).option("checkpointLocation", ckpt)
    if interval > 0:
        writer = writer.trigger(processingTime=f"{int(interval * 1000)} milliseconds")
    q = writer.start()
    stop.wait()
    q.stop()


def onceflow_pg(spark, bootstrap, topic, dsn, table, ckpt, interval, stop) -> None:
    from onceflow import PostgresSink

    _job(spark, bootstrap, topic, table, ckpt, interval, stop,
         PostgresSink(dsn, table, mode="two_phase", create_table=True))


def at_least_once_pg(spark, bootstrap, topic, dsn, table, ckpt, interval, stop) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (id bigint, created_ns bigint)")

    def write(df, batch_id) -> None:
        rows = df.collect()
        with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor() as cur:
            with cur.copy(f"COPY {table} (id, created_ns) FROM STDIN") as copy:
                for r in rows:
                    copy.write_row((r[0], r[1]))

    _foreach_batch(spark, bootstrap, topic, ckpt, interval, stop, write)


def onceflow_delta(spark, bootstrap, topic, root, table, ckpt, interval, stop) -> None:
    from onceflow import DeltaSink

    _job(spark, bootstrap, topic, table, ckpt, interval, stop, DeltaSink(f"{root}/{table}"))


def at_least_once_delta(spark, bootstrap, topic, root, table, ckpt, interval, stop) -> None:
    from deltalake import write_deltalake

    def write(df, batch_id) -> None:  # no idempotence: a replayed batch is appended again
        write_deltalake(f"{root}/{table}", df.toArrow(), mode="append")

    _foreach_batch(spark, bootstrap, topic, ckpt, interval, stop, write)


#: sink -> (watcher, counter, [(writer name, writer)]): onceflow's first, then its baseline
SINKS = {
    "postgres": (watch_pg, count_pg, [("onceflow two_phase", onceflow_pg),
                                      ("at-least-once foreachBatch+COPY", at_least_once_pg)]),
    "delta": (watch_delta, count_delta, [("onceflow DeltaSink", onceflow_delta),
                                         ("at-least-once foreachBatch+write_deltalake", at_least_once_delta)]),
}


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


def measure(name: str, runner, watch, count, where: str, spark, broker: KafkaBroker, args, root: str,
            phases: Phases) -> dict:
    """One writer's run (see module doc); ``where``: the DSN or the tables' directory."""
    topic, table = f"fresh-{uuid.uuid4().hex[:6]}", f"fresh_{uuid.uuid4().hex[:6]}"
    create_topic(broker.bootstrap, topic, args.partitions)
    total = args.rate * args.seconds
    acks, created, seen = (np.zeros(total + 1, np.int64) for _ in range(3))
    produced, stop_job, stop_watch = threading.Event(), threading.Event(), threading.Event()
    job = threading.Thread(target=runner, args=(spark, broker.bootstrap, topic, where, table, f"{root}/ckpt-{table}",
                                                args.interval, stop_job), daemon=True)
    watcher = threading.Thread(target=watch, args=(where, table, seen, stop_watch), daemon=True)
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
                                           produced, args.linger_ms, args.partitions), daemon=True).start()
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
    rows, distinct = count(where, table)
    acks, created, seen = acks[:total], created[:total], seen[:total]
    first = int(created[0])
    counted = (created - first) >= args.warmup * 1e9
    ok = seen[counted] > 0
    from_created = (seen[counted][ok] - created[counted][ok]) / 1e6
    acked = ok & (acks[counted] > 0)
    from_ack = (seen[counted][acked] - acks[counted][acked]) / 1e6
    span = (seen[counted][ok].max() - seen[counted][ok].min()) / 1e9 if ok.any() else 0
    return {"writer": name, "events": int(counted.sum()), "missing": int((~ok).sum()), "rows": rows - 1 - args.partitions,
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
    ap.add_argument("--linger-ms", type=float, default=5.0,
                    help="the producer's linger.ms (librdkafka's default 5; 0: one record per request)")
    ap.add_argument("--interval", type=float, default=0.0, help="trigger interval, seconds (0: back to back)")
    ap.add_argument("--sinks", default="postgres,delta", help=f"comma-separated, of {', '.join(SINKS)}")
    ap.add_argument("--start-timeout", type=float, default=180.0, help="seconds the writer may take to start")
    args = ap.parse_args()
    sinks = args.sinks.split(",")
    if unknown := [s for s in sinks if s not in SINKS]:
        raise SystemExit(f"--sinks: unknown {', '.join(unknown)}; choose from {', '.join(SINKS)}")
    from onceflow.spark import get_spark

    root = tempfile.mkdtemp(prefix="bench-freshness-")
    pg = PgCluster(max_prepared_transactions=20, fsync=True, name="fresh") if "postgres" in sinks else None
    spark = get_spark("local[2]", "bench-freshness")
    results: list[list[dict]] = []
    try:
        with KafkaBroker() as broker:
            phases = Phases(spark)
            for sink in sinks:
                watch, count, writers = SINKS[sink]
                where = pg.dsn if sink == "postgres" else root
                results.append([measure(name, runner, watch, count, where, spark, broker, args, root, phases)
                                for name, runner in writers])
    finally:
        spark.stop()
        if pg is not None:
            pg.destroy()
    print(f"Kafka (tansu) -> {' and '.join(sinks)} at {args.rate:,} events/s, {args.partitions} partitions, "
          f"interval {args.interval:g} s; {args.seconds} s of events per writer, the first {args.warmup:g} s not counted")
    print(f"{'writer':44} {'events':>8} {'missing':>7} {'dups':>5} {'ev/s':>7}  {'from creation p50/p99/max ms':>30}  "
          f"{'from broker ack p50/p99/max ms':>30}")
    for r in (r for pair in results for r in pair):
        c, a = r["created_ms"], r["ack_ms"]
        print(f"{r['writer']:44} {r['events']:>8,} {r['missing']:>7} {r['duplicates']:>5} {r['throughput']:>7,.0f}  "
              f"{c[0]:>10,.0f}/{c[1]:>8,.0f}/{c[2]:>8,.0f}  {a[0]:>10,.0f}/{a[1]:>8,.0f}/{a[2]:>8,.0f}")
    print("median milliseconds per micro-batch with input (Spark's durationMs; triggerExecution is the whole batch):")
    for r in (r for pair in results for r in pair):
        shown = ", ".join(f"{k} {v:,.0f}" for k, v in r["phases"].items() if v >= 1)
        print(f"  {r['writer']:44} {r['batches']:>4} batches: {shown}")
    for sink, (eo, alo) in zip(sinks, results, strict=True):
        print(f"{sink}: exactly-once p99 / at-least-once p99 (from the ack): {eo['ack_ms'][1] / alo['ack_ms'][1]:.2f}x")
    sys.exit(0 if all(eo["missing"] == 0 and eo["duplicates"] == 0 for eo, _ in results) else 1)


if __name__ == "__main__":
    main()
