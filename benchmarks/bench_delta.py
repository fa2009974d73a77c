"""Delta sink throughput vs Spark's built-in Parquet file sink (exactly-once baseline).

One command: ``python benchmarks/bench_delta.py [--per-batch M] [--batches K] [--repeat R]
[--pipelines stateless,payload] [--partitions N]``. Same session, same source (Spark's ``rate-micro-batch``:
exactly M rows per micro-batch, so every sink sees identical batches), and two pipelines:

- ``stateless``: ``value AS id, value % 1000 AS k`` (the pipeline of the Flink comparison in
  docs/delta-sink.md);
- ``payload``: id, key, event time and a payload string.

Each sink runs one long query per timed run, as a stream runs in production: a trigger every
``--interval`` seconds (longer than a batch takes), and the query is stopped in the pause after
batch K+1, so it never stops mid-batch and prints no stack trace. Rows/s = rows of batches
2..K+1 divided by the sum of their trigger times (batch 0 pays query start-up, batch 1 the first
Python callback). ``--query-per-batch`` instead runs each batch as its own
``Trigger.AvailableNow`` query (the method of the figures before 2026-11-25), which also charges
every batch a query start. The best of R timed runs is reported, with the ratio against the
Parquet sink measured in the same run, and every run's output is counted so that a sink that
dropped rows cannot win.

``--partitions N`` (e.g. 32) adds a column ``part = value % N`` and partitions every sink by it:
Spark's Parquet sink with ``partitionBy("part")``, the Delta sinks with
``DeltaSink(partition_by=["part"])`` (a partitioned table, Hive-style directories).

The onceflow sinks' queries start as a Job's do (``onceflow.spark.query_conf``: Spark's
checkpoint files written by the FileSystem-based manager on a local disk). The Parquet sink
runs twice: as Spark runs it by default (the baseline of the ratios) and with those same
checkpoint settings (the second ratio: the sinks alone).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

from onceflow.spark import get_spark, query_conf

PIPELINES = {
    "stateless": ("value AS id", "value % 1000 AS k"),
    "payload": ("value AS id", "value % 16 AS key", "timestamp AS event_time", "concat('payload-', value) AS payload"),
}
#: label -> (format, whether the query starts as a Job's does: onceflow's checkpoint settings)
SINKS = {"parquet (built-in file sink)": ("parquet", False),
         "parquet, onceflow's checkpoint settings": ("parquet", True),
         "onceflow-delta (arrow)": ("onceflow-delta", True),
         "onceflow-delta (jvm, the default here)": ("onceflow-delta-jvm", True)}
BASE, SAME = "parquet (built-in file sink)", "parquet, onceflow's checkpoint settings"


def written(spark, fmt: str, out: str) -> int:
    if fmt.startswith("onceflow-delta"):
        from deltalake import DeltaTable

        return DeltaTable(out).to_pyarrow_dataset().count_rows()
    return spark.read.parquet(out).count()


def jvm_writer(df, out: str, ckpt: str, partition_by: list[str] | None = None):
    """DeltaSink(writer="jvm") started as the Job runner starts it: open (epoch, recovery),
    then its foreachBatch writer."""
    from onceflow.checkpoint.layout import CheckpointDir
    from onceflow.runtime.runner import ensure_lineage
    from onceflow.sinks.delta import DeltaSink

    sink = DeltaSink(out, writer="jvm", partition_by=partition_by)
    source = sink.data_source({"checkpointlocation": ckpt})
    source.write_schema = df.schema
    source.validate(df.schema, False)
    source.open(ensure_lineage(CheckpointDir(ckpt)))
    return sink.stream_writer(df, source, sink.options(), False)


def _query(spark, fmt: str, pipeline: str, per_batch: int, out: str, ckpt: str, trigger: dict, as_job: bool,
           partitions: int = 0):
    columns = PIPELINES[pipeline] + ((f"value % {partitions} AS part",) if partitions else ())
    df = (spark.readStream.format("rate-micro-batch").option("rowsPerBatch", per_batch)
          .option("numPartitions", 2).load().selectExpr(*columns))
    parts = ["part"] if partitions else None
    if fmt == "onceflow-delta-jvm":
        writer = jvm_writer(df, out, ckpt, parts)
    else:
        writer = df.writeStream.format(fmt).option("path", out)
        if parts and fmt == "parquet":
            writer = writer.partitionBy(*parts)
        elif parts:
            writer = writer.option("partition_by", ",".join(parts))
    writer = writer.option("checkpointLocation", ckpt).trigger(**trigger)
    if not as_job:
        return writer.start()
    with query_conf(spark, ckpt):  # as the Job runner starts its query
        return writer.start()


def _check(fmt: str, q) -> None:
    if q.exception():
        raise SystemExit(f"{fmt}: {q.exception()}")


def run(spark, fmt: str, pipeline: str, per_batch: int, batches: int, root: str,
        interval: float, query_per_batch: bool = False, as_job: bool = True, partitions: int = 0) -> float:
    """Rows/s of batches 2..``batches``+1 (see the module doc)."""
    out, ckpt = f"{root}/out", f"{root}/ckpt"
    shutil.rmtree(root, ignore_errors=True)
    last = batches + 1
    if query_per_batch:
        progress = []
        for _ in range(last + 1):
            q = _query(spark, fmt, pipeline, per_batch, out, ckpt, {"availableNow": True}, as_job, partitions)
            q.awaitTermination()
            _check(fmt, q)
            progress += [p for p in q.recentProgress if p.numInputRows]
    else:
        q = _query(spark, fmt, pipeline, per_batch, out, ckpt, {"processingTime": f"{int(interval * 1000)} milliseconds"},
                   as_job, partitions)
        while (q.lastProgress or {}).get("batchId", -1) < last or q.status["isTriggerActive"]:
            _check(fmt, q)
            time.sleep(0.02)
        q.stop()  # between triggers: the next one is at least half an interval away
        _check(fmt, q)
        progress = [p for p in q.recentProgress if p.numInputRows]
        if any(p.durationMs["triggerExecution"] > interval * 1000 for p in progress[2:]):
            print(f"  note: a batch took longer than --interval {interval:g}s; raise it if a query stops mid-batch")
    # every batch that completed counts for the output check (on a busy machine one more
    # trigger may finish before the stop); only batches 2..last are timed
    expected = sum(p.numInputRows for p in progress)
    timed = [p for p in progress if 2 <= p.batchId <= last]
    rows = sum(p.numInputRows for p in timed)
    seconds = sum(p.durationMs["triggerExecution"] for p in timed) / 1000
    total = written(spark, fmt, out)
    if total != expected:
        raise SystemExit(f"{fmt}: {total:,} rows in the output, expected {expected:,}")
    return rows / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-batch", type=int, default=1_000_000)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--pipelines", default="stateless,payload")
    ap.add_argument("--interval", type=float, default=2.0,
                    help="seconds between triggers; longer than one batch takes")
    ap.add_argument("--partitions", type=int, default=0,
                    help="partition every sink by value %% N (0: unpartitioned)")
    ap.add_argument("--query-per-batch", action="store_true",
                    help="each batch its own AvailableNow query (charges a query start per batch)")
    args = ap.parse_args()
    spark = get_spark("local[2]", "bench-delta")
    tmp = tempfile.mkdtemp(prefix="onceflow-bench-")
    for pipeline in args.pipelines.split(","):
        for i, (fmt, as_job) in enumerate(SINKS.values()):  # warm-up: JIT, Python workers, Delta table cache
            run(spark, fmt, pipeline, args.per_batch, 1, f"{tmp}/warm-{i}", args.interval, args.query_per_batch, as_job,
                args.partitions)
        best: dict[str, float] = {}
        for r in range(args.repeat):
            for i, (name, (fmt, as_job)) in enumerate(SINKS.items()):
                rate = run(spark, fmt, pipeline, args.per_batch, args.batches, f"{tmp}/{pipeline}-{i}-{r}",
                           args.interval, args.query_per_batch, as_job, args.partitions)
                best[name] = max(best.get(name, 0.0), rate)
                print(f"  {pipeline} run {r + 1}: {name:40s} {rate:12,.0f} rows/s", flush=True)
        base = best[BASE]
        print(f"\n{pipeline}: per_batch={args.per_batch:,} batches={args.batches} partitions={args.partitions} "
              f"(best of {args.repeat})")
        same = best[SAME]
        print(f"  (ratios: against {BASE!r} / against {SAME!r})")
        for name, rate in best.items():
            print(f"  {name:40s} {rate:12,.0f} rows/s   ratio {rate / base:5.2f}x / {rate / same:5.2f}x")
        print()
    shutil.rmtree(tmp, ignore_errors=True)
    spark.stop()


if __name__ == "__main__":
    main()
