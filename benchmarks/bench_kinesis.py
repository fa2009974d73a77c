"""Kinesis source throughput per shard vs a raw boto3 GetRecords loop, on the same kinesalite.

One command: ``python benchmarks/bench_kinesis.py [--records N] [--max-records-per-trigger M]
[--repeat R]``. Starts its own kinesalite (in memory, see tests/kinesis_server.py), writes N
~100-byte JSON records to a 1-shard stream, then in the same run measures (best of R after a
warm-up):

1. raw: one boto3 client, ``GetShardIterator(TRIM_HORIZON)`` and ``GetRecords(Limit=10000)``
   until an empty answer, records decoded by boto3 as any consumer gets them;
2. KinesisSource (TRIM_HORIZON) -> ``format("noop")`` with ``Trigger.AvailableNow`` (one
   Spark task: the shard), ``maxRecordsPerTrigger`` M (0: everything in one batch).

Spark figures: wall time from ``start()`` to the end of the query (start-up included) and
"batch time", the sum of the batches' ``triggerExecution`` durations (planning, which reads
ahead on the driver to find each batch's last sequence number, included). The target
(>= 0.8x the raw loop) is judged on batch time; both are printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

from kinesis_server import Kinesalite  # noqa: E402
from onceflow.sources.kinesis import KinesisSource  # noqa: E402
from onceflow.spark import get_spark  # noqa: E402

SHARD = "shardId-000000000000"


def fill(k: Kinesalite, stream: str, records: int) -> None:
    pad = "x" * 64
    k.put(stream, ((str(i), f'{{"id": {i}, "pad": "{pad}"}}'.encode()) for i in range(records)))


def raw_loop(k: Kinesalite, stream: str) -> tuple[int, float]:
    c = k.client()
    started = time.perf_counter()
    it = c.get_shard_iterator(StreamName=stream, ShardId=SHARD, ShardIteratorType="TRIM_HORIZON")["ShardIterator"]
    n = 0
    while it:
        out = c.get_records(ShardIterator=it, Limit=10_000)
        n += sum(len(r["Data"]) > 0 for r in out["Records"])
        it = out.get("NextShardIterator")
        if not out["Records"]:
            break
    return n, time.perf_counter() - started


def source_run(spark, k: Kinesalite, stream: str, per_trigger: int, work: str) -> tuple[int, float, float]:
    ckpt = tempfile.mkdtemp(dir=work)
    # event_log = the checkpoint (what a onceflow Job sets): the driver's read-ahead is spilled there
    df = KinesisSource(stream, starting_position="TRIM_HORIZON", max_records_per_trigger=per_trigger or None,
                       event_log=ckpt, **k.source_options()).load(spark)
    started = time.perf_counter()
    q = (df.writeStream.format("noop").option("checkpointLocation", ckpt)
         .trigger(availableNow=True).start())
    q.awaitTermination()
    wall = time.perf_counter() - started
    if q.exception() is not None:
        raise q.exception()
    progress = q.recentProgress
    rows = sum(p["numInputRows"] for p in progress)
    batch_s = sum(p["durationMs"].get("triggerExecution", 0) for p in progress if p["numInputRows"]) / 1000
    return rows, wall, batch_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--max-records-per-trigger", type=int, default=50_000)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench-kinesis-")
    try:
        with Kinesalite() as k:
            k.create_stream("bench", 1)
            t = time.perf_counter()
            fill(k, "bench", args.records)
            print(f"wrote {args.records:,} records to a 1-shard stream in {time.perf_counter() - t:.1f} s")
            spark = get_spark("local[2]", "bench-kinesis")
            spark.sparkContext.setLogLevel("ERROR")
            raw_loop(k, "bench")  # warm-up
            source_run(spark, k, "bench", args.max_records_per_trigger, work)
            raws, runs = [], []
            for _ in range(args.repeat):
                n, secs = raw_loop(k, "bench")
                assert n == args.records, f"raw loop read {n}"
                raws.append(n / secs)
                rows, wall, batch_s = source_run(spark, k, "bench", args.max_records_per_trigger, work)
                assert rows == args.records, f"source read {rows}"
                runs.append((rows / batch_s, rows / wall))
            raw = max(raws)
            batch_rate, wall_rate = max(runs)
            print(f"raw boto3 GetRecords loop, 1 shard : {raw:>10,.0f} rows/s")
            print(f"KinesisSource -> noop, 1 shard     : {batch_rate:>10,.0f} rows/s batch time "
                  f"({batch_rate / raw:.2f}x raw), {wall_rate:,.0f} rows/s wall ({wall_rate / raw:.2f}x)")
            print(f"(best of {args.repeat}; maxRecordsPerTrigger "
                  f"{args.max_records_per_trigger or 'none'}; target >= 0.8x on batch time)")
            spark.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
