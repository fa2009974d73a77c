"""Iceberg sink throughput vs Spark's built-in Parquet file sink, same run, same batches.

One command: ``python benchmarks/bench_iceberg.py [--per-batch 1000000] [--batches 6]
[--repeat 2] [--pipelines stateless,payload]``. The method is bench_delta.py's: Spark's
``rate-micro-batch`` source (exactly M rows per micro-batch), one long query per timed run with
a trigger every ``--interval`` seconds, stopped between triggers after batch K+1; rows/s = rows
of batches 2..K+1 over the sum of their trigger times (batch 0 pays query start-up, batch 1 the
first Python callback); best of R runs; every run's output is counted (the Iceberg table through
pyiceberg's scan), so a sink that dropped rows cannot win.

The Iceberg sink runs as ``writeStream.format("onceflow-iceberg")`` on an SQLite catalog (tasks
write Parquet with pyarrow; the driver commits one snapshot per batch with ``add_files``), with
Iceberg's default codec (zstd) and with snappy, the codec Spark's Parquet sink writes. The
Parquet sink runs as Spark runs it by default (the baseline) and with onceflow's checkpoint
settings (``onceflow.spark.query_conf``, as a Job's query starts; the second ratio).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

from onceflow.spark import get_spark, query_conf, register_all

PIPELINES = {
    "stateless": ("value AS id", "value % 1000 AS k"),
    "payload": ("value AS id", "value % 16 AS key", "timestamp AS event_time", "concat('payload-', value) AS payload"),
}
#: label -> (format, whether the query starts with onceflow's checkpoint settings)
SINKS = {"parquet (built-in file sink)": ("parquet", False),
         "parquet, onceflow's checkpoint settings": ("parquet", True),
         "onceflow-iceberg (sqlite catalog)": ("onceflow-iceberg", True),
         "onceflow-iceberg, snappy (as Parquet's)": ("onceflow-iceberg:snappy", True)}
BASE, SAME = "parquet (built-in file sink)", "parquet, onceflow's checkpoint settings"


def _catalog(root: str) -> str:
    return f"sqlite:///{root}/catalog.db"


def written(spark, fmt: str, out: str) -> int:
    if fmt.startswith("onceflow-iceberg"):
        from pyiceberg.catalog.sql import SqlCatalog

        table = SqlCatalog("onceflow", uri=_catalog(out)).load_table("bench.events")
        return sum(int(s.summary["added-records"] or 0) for s in table.metadata.snapshots
                   if s.summary is not None and s.summary["added-records"])
    return spark.read.parquet(out).count()


def _query(spark, fmt: str, pipeline: str, per_batch: int, out: str, ckpt: str, interval: float, as_job: bool):
    df = (spark.readStream.format("rate-micro-batch").option("rowsPerBatch", per_batch)
          .option("numPartitions", 2).load().selectExpr(*PIPELINES[pipeline]))
    if fmt.startswith("onceflow-iceberg"):
        fmt, _, codec = fmt.partition(":")  # the data files' codec: zstd (Iceberg's default) or as named
        writer = (df.writeStream.format(fmt).option("catalog", _catalog(out)).option("table", "bench.events")
                  .option("compression", codec or "zstd"))
    else:
        writer = df.writeStream.format(fmt).option("path", out)
    writer = writer.option("checkpointLocation", ckpt).trigger(processingTime=f"{int(interval * 1000)} milliseconds")
    if not as_job:
        return writer.start()
    with query_conf(spark, ckpt):
        return writer.start()


def run(spark, fmt: str, pipeline: str, per_batch: int, batches: int, root: str, interval: float,
        as_job: bool) -> float:
    """Rows/s of batches 2..``batches``+1 (see the module doc)."""
    out, ckpt = f"{root}/out", f"{root}/ckpt"
    shutil.rmtree(root, ignore_errors=True)
    last = batches + 1
    q = _query(spark, fmt, pipeline, per_batch, out, ckpt, interval, as_job)
    while (q.lastProgress or {}).get("batchId", -1) < last or q.status["isTriggerActive"]:
        if q.exception():
            raise SystemExit(f"{fmt}: {q.exception()}")
        time.sleep(0.02)
    q.stop()
    every = [p for p in q.recentProgress if p.numInputRows]  # a batch after K+1 may have run
    progress = [p for p in every if p.batchId <= last]
    if any(p.durationMs["triggerExecution"] > interval * 1000 for p in progress[2:]):
        print(f"  note: a batch took longer than --interval {interval:g}s; raise it if a query stops mid-batch")
    timed = [p for p in progress if p.batchId >= 2]
    rows = sum(p.numInputRows for p in timed)
    seconds = sum(p.durationMs["triggerExecution"] for p in timed) / 1000
    total, expected = written(spark, fmt, out), sum(p.numInputRows for p in every)
    if total != expected:
        raise SystemExit(f"{fmt}: {total:,} rows in the output, expected {expected:,}")
    return rows / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-batch", type=int, default=1_000_000)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--pipelines", default="stateless,payload")
    ap.add_argument("--interval", type=float, default=3.0, help="seconds between triggers; longer than a batch takes")
    args = ap.parse_args()
    spark = get_spark("local[2]", "bench-iceberg")
    register_all(spark)
    tmp = tempfile.mkdtemp(prefix="onceflow-bench-iceberg-")
    for pipeline in args.pipelines.split(","):
        for i, (fmt, as_job) in enumerate(SINKS.values()):  # warm-up: JIT, Python workers
            run(spark, fmt, pipeline, args.per_batch, 1, f"{tmp}/warm-{i}", args.interval, as_job)
        best: dict[str, float] = {}
        for r in range(args.repeat):
            for i, (name, (fmt, as_job)) in enumerate(SINKS.items()):
                rate = run(spark, fmt, pipeline, args.per_batch, args.batches, f"{tmp}/{pipeline}-{i}-{r}",
                           args.interval, as_job)
                best[name] = max(best.get(name, 0.0), rate)
                print(f"  {pipeline} run {r + 1}: {name:40s} {rate:12,.0f} rows/s", flush=True)
        print(f"\n{pipeline}: per_batch={args.per_batch:,} batches={args.batches} (best of {args.repeat})")
        print(f"  (ratios: against {BASE!r} / against {SAME!r})")
        for name, rate in best.items():
            print(f"  {name:40s} {rate:12,.0f} rows/s   ratio {rate / best[BASE]:5.2f}x / {rate / best[SAME]:5.2f}x")
        print()
    shutil.rmtree(tmp, ignore_errors=True)
    spark.stop()


if __name__ == "__main__":
    main()
