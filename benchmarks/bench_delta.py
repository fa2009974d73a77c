"""Delta sink throughput vs Spark's built-in Parquet file sink (exactly-once baseline).

One command: ``python benchmarks/bench_delta.py [--rows N] [--per-batch M] [--repeat R]``.
Same session, same source (onceflow-sequence: id, key, event_time, plus a payload string),
same micro-batches; prints rows/s for both and the ratio. Each sink gets a warm-up run first
(Python worker start-up is not what we measure); the best of R timed runs is reported.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

from onceflow.spark import get_spark


def pipeline(spark, rows: int, per_batch: int):
    return (
        spark.readStream.format("onceflow-sequence")
        .option("total", rows).option("rows_per_second", 10**12)
        .option("max_rows_per_batch", per_batch).option("partitions", 2).load()
        .selectExpr("id", "key", "event_time", "concat('payload-', id) AS payload")
    )


def run(spark, fmt: str, rows: int, per_batch: int, root: str, **opts) -> float:
    out, ckpt = f"{root}/out", f"{root}/ckpt"
    shutil.rmtree(root, ignore_errors=True)
    writer = pipeline(spark, rows, per_batch).writeStream.format(fmt).option("checkpointLocation", ckpt)
    for k, v in {"path": out, **opts}.items():
        writer = writer.option(k, v)
    start = time.perf_counter()
    q = writer.start()
    q.processAllAvailable()
    elapsed = time.perf_counter() - start
    q.stop()
    return rows / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--per-batch", type=int, default=500_000)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    spark = get_spark("local[2]", "bench-delta")
    tmp = tempfile.mkdtemp(prefix="onceflow-bench-")
    sinks = {"parquet (built-in file sink)": ("parquet", {}), "onceflow-delta": ("onceflow-delta", {})}
    for fmt, opts in sinks.values():  # warm-up
        run(spark, fmt, args.per_batch, args.per_batch, f"{tmp}/warm-{fmt}", **opts)
    best: dict[str, float] = {}
    for r in range(args.repeat):
        for name, (fmt, opts) in sinks.items():
            rate = run(spark, fmt, args.rows, args.per_batch, f"{tmp}/{fmt}-{r}", **opts)
            best[name] = max(best.get(name, 0.0), rate)
            print(f"  run {r + 1}: {name:32s} {rate:12,.0f} rows/s", flush=True)
    base = best["parquet (built-in file sink)"]
    print(f"\nrows={args.rows:,} per_batch={args.per_batch:,} (best of {args.repeat})")
    for name, rate in best.items():
        print(f"{name:32s} {rate:12,.0f} rows/s   ratio {rate / base:5.2f}x")
    print("target: onceflow-delta >= 0.80x the built-in file sink")
    shutil.rmtree(tmp, ignore_errors=True)
    spark.stop()


if __name__ == "__main__":
    main()
