"""Delta sink throughput vs Spark's built-in Parquet file sink (exactly-once baseline).

One command: ``python benchmarks/bench_delta.py [--per-batch M] [--batches K] [--repeat R]
[--pipelines stateless,payload]``. Same session, same source (Spark's ``rate-micro-batch``:
exactly M rows per micro-batch, so every sink sees identical batches), and two pipelines:

- ``stateless``: ``value AS id, value % 1000 AS k`` (the pipeline of the Flink comparison in
  docs/delta-sink.md);
- ``payload``: id, key, event time and a payload string.

Each batch is one ``Trigger.AvailableNow`` run of the query on the same checkpoint, so every
run ends at a batch boundary (no query is stopped mid-batch). Rows/s = rows of batches 1..K
divided by the sum of their trigger times (batch 0 pays query start-up). Each sink gets a
warm-up batch first; the best of R timed runs is reported, with the ratio against the
Parquet sink measured in the same run, and every run's output is counted so that a sink that
dropped rows cannot win.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile

from onceflow.spark import get_spark

PIPELINES = {
    "stateless": ("value AS id", "value % 1000 AS k"),
    "payload": ("value AS id", "value % 16 AS key", "timestamp AS event_time", "concat('payload-', value) AS payload"),
}
SINKS = {"parquet (built-in file sink)": "parquet", "onceflow-delta (arrow)": "onceflow-delta",
         "onceflow-delta (jvm)": "onceflow-delta-jvm"}


def written(spark, fmt: str, out: str) -> int:
    if fmt.startswith("onceflow-delta"):
        from deltalake import DeltaTable

        return DeltaTable(out).to_pyarrow_dataset().count_rows()
    return spark.read.parquet(out).count()


def jvm_writer(df, out: str, ckpt: str):
    """DeltaSink(writer="jvm") started as the Job runner starts it: open (epoch, recovery),
    then its foreachBatch writer."""
    from onceflow.checkpoint.layout import CheckpointDir
    from onceflow.runtime.runner import ensure_lineage
    from onceflow.sinks.delta import DeltaSink

    sink = DeltaSink(out, writer="jvm")
    source = sink.data_source({"checkpointlocation": ckpt})
    source.write_schema = df.schema
    source.validate(df.schema, False)
    source.open(ensure_lineage(CheckpointDir(ckpt)))
    return sink.stream_writer(df, source, sink.options(), False)


def run(spark, fmt: str, pipeline: str, per_batch: int, batches: int, root: str) -> float:
    """Rows/s of batches 1..``batches``, each one AvailableNow run ending at its boundary."""
    out, ckpt = f"{root}/out", f"{root}/ckpt"
    shutil.rmtree(root, ignore_errors=True)
    progress = []
    for _ in range(batches + 1):
        df = (spark.readStream.format("rate-micro-batch").option("rowsPerBatch", per_batch)
              .option("numPartitions", 2).load().selectExpr(*PIPELINES[pipeline]))
        if fmt == "onceflow-delta-jvm":
            writer = jvm_writer(df, out, ckpt)
        else:
            writer = df.writeStream.format(fmt).option("path", out)
        q = writer.option("checkpointLocation", ckpt).trigger(availableNow=True).start()
        q.awaitTermination()
        if q.exception():
            raise SystemExit(f"{fmt}: {q.exception()}")
        progress += [p for p in q.recentProgress if p.numInputRows]
    timed = progress[1 : batches + 1]
    rows = sum(p.numInputRows for p in timed)
    seconds = sum(p.durationMs["triggerExecution"] for p in timed) / 1000
    total = written(spark, fmt, out)
    if total != rows + progress[0].numInputRows:
        raise SystemExit(f"{fmt}: {total:,} rows in the output, expected {rows + progress[0].numInputRows:,}")
    return rows / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-batch", type=int, default=1_000_000)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--pipelines", default="stateless,payload")
    args = ap.parse_args()
    spark = get_spark("local[2]", "bench-delta")
    tmp = tempfile.mkdtemp(prefix="onceflow-bench-")
    for pipeline in args.pipelines.split(","):
        for fmt in SINKS.values():  # warm-up
            run(spark, fmt, pipeline, args.per_batch, 1, f"{tmp}/warm-{fmt}")
        best: dict[str, float] = {}
        for r in range(args.repeat):
            for name, fmt in SINKS.items():
                rate = run(spark, fmt, pipeline, args.per_batch, args.batches, f"{tmp}/{pipeline}-{fmt}-{r}")
                best[name] = max(best.get(name, 0.0), rate)
                print(f"  {pipeline} run {r + 1}: {name:30s} {rate:12,.0f} rows/s", flush=True)
        base = best["parquet (built-in file sink)"]
        print(f"\n{pipeline}: per_batch={args.per_batch:,} batches={args.batches} (best of {args.repeat})")
        for name, rate in best.items():
            print(f"  {name:30s} {rate:12,.0f} rows/s   ratio {rate / base:5.2f}x")
        print()
    shutil.rmtree(tmp, ignore_errors=True)
    spark.stop()


if __name__ == "__main__":
    main()
