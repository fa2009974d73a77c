"""Delta sink throughput vs Spark's built-in Parquet file sink (exactly-once baseline).

One command: ``python benchmarks/bench_delta.py [--per-batch M] [--batches K] [--repeat R]``.
Same session, same source (Spark's ``rate-micro-batch``: exactly M rows per micro-batch, so
both sinks see identical batches), same transform (id, key, event time, a payload string);
prints rows/s for both and the ratio. Rows/s = rows of batches 1..K divided by the sum of their
trigger times (batch 0 pays query start-up). Each sink gets a warm-up run first (Python worker
start-up is not what we measure); the best of R timed runs is reported, and every run's output
is counted so that a sink that dropped rows cannot win.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

from onceflow.spark import get_spark


def pipeline(spark, per_batch: int):
    return (
        spark.readStream.format("rate-micro-batch").option("rowsPerBatch", per_batch)
        .option("numPartitions", 2).load()
        .selectExpr("value AS id", "value % 16 AS key", "timestamp AS event_time",
                    "concat('payload-', value) AS payload")
    )


def written(spark, fmt: str, out: str) -> int:
    if fmt == "onceflow-delta":
        from deltalake import DeltaTable

        return DeltaTable(out).to_pyarrow_dataset().count_rows()
    return spark.read.parquet(out).count()


def run(spark, fmt: str, per_batch: int, batches: int, root: str) -> float:
    out, ckpt = f"{root}/out", f"{root}/ckpt"
    shutil.rmtree(root, ignore_errors=True)
    q = (pipeline(spark, per_batch).writeStream.format(fmt).option("checkpointLocation", ckpt)
         .option("path", out).start())
    try:
        while True:
            done = [p for p in q.recentProgress if p.numInputRows]
            if len(done) >= batches + 1:
                break
            if q.exception():
                raise RuntimeError(str(q.exception()))
            time.sleep(0.05)
    finally:
        q.stop()
    timed = done[1 : batches + 1]
    rows = sum(p.numInputRows for p in timed)
    seconds = sum(p.durationMs["triggerExecution"] for p in timed) / 1000
    total = written(spark, fmt, out)
    if total < rows:
        raise SystemExit(f"{fmt}: only {total:,} of at least {rows:,} rows in the output")
    return rows / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-batch", type=int, default=500_000)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    spark = get_spark("local[2]", "bench-delta")
    spark.sparkContext.setLogLevel("ERROR")  # stopping a query mid-batch logs interrupts
    tmp = tempfile.mkdtemp(prefix="onceflow-bench-")
    sinks = {"parquet (built-in file sink)": "parquet", "onceflow-delta": "onceflow-delta"}
    for fmt in sinks.values():  # warm-up
        run(spark, fmt, args.per_batch, 1, f"{tmp}/warm-{fmt}")
    best: dict[str, float] = {}
    for r in range(args.repeat):
        for name, fmt in sinks.items():
            rate = run(spark, fmt, args.per_batch, args.batches, f"{tmp}/{fmt}-{r}")
            best[name] = max(best.get(name, 0.0), rate)
            print(f"  run {r + 1}: {name:32s} {rate:12,.0f} rows/s", flush=True)
    base = best["parquet (built-in file sink)"]
    print(f"\nper_batch={args.per_batch:,} batches={args.batches} (best of {args.repeat})")
    for name, rate in best.items():
        print(f"{name:32s} {rate:12,.0f} rows/s   ratio {rate / base:5.2f}x")
    ratio = best["onceflow-delta"] / base
    print(f"target: onceflow-delta >= 0.80x the built-in file sink: {'met' if ratio >= 0.8 else 'NOT met'}")
    shutil.rmtree(tmp, ignore_errors=True)
    spark.stop()


if __name__ == "__main__":
    main()
