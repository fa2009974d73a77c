"""The demo's stateful running count: ``applyInPandasWithState`` vs ``transformWithStateInPandas``.

One command: ``python benchmarks/bench_stateful.py [--events N] [--per-batch M] [--repeat R]``.
Same session, same source (onceflow's sequence source, 16 keys, M rows per micro-batch), same
sink (onceflow-delta), same state store (RocksDB: ``transformWithStateInPandas`` needs it), and
the same output: each event with its key's running count. Each variant runs the whole stream
until every event went through a completed batch; rows/s = events / the summed trigger time of the batches after
the first (which pays Python worker start-up). The best of R runs is reported, with the ratio
against ``applyInPandasWithState`` measured in the same run, and every run's output is
checked (ids once each, running counts exact) so that a variant that drops or miscounts rows
cannot win.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Iterator

from onceflow.demo.job import OUTPUT
from onceflow.demo.job import transform as apply_in_pandas_with_state
from onceflow.spark import get_spark
from onceflow.verify.exactly_once import check_delta_table


def transform_with_state(df):
    """The running count with Spark 4's ``transformWithStateInPandas`` (a ValueState per key)."""
    import numpy as np
    import pandas as pd
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor
    from pyspark.sql.types import LongType, StructField, StructType

    class RunningCount(StatefulProcessor):
        def init(self, handle) -> None:
            self.count = handle.getValueState("count", StructType([StructField("count", LongType())]))

        def handleInputRows(self, key, rows: Iterator[pd.DataFrame], timerValues) -> Iterator[pd.DataFrame]:
            seen = self.count.get()[0] if self.count.exists() else 0
            batch = pd.concat(list(rows)).sort_values("id")
            batch["running_count"] = seen + np.arange(1, len(batch) + 1, dtype="int64")
            self.count.update((seen + len(batch),))
            yield batch[["id", "key", "event_time", "running_count"]]

        def close(self) -> None:
            pass

    return df.groupBy("key").transformWithStateInPandas(
        RunningCount(), outputStructType=OUTPUT, outputMode="append", timeMode="None")


VARIANTS = {"applyInPandasWithState": apply_in_pandas_with_state,
            "transformWithStateInPandas": transform_with_state}


def run(spark, fn, events: int, per_batch: int, root: str) -> float:
    shutil.rmtree(root, ignore_errors=True)
    df = (spark.readStream.format("onceflow-sequence").option("total", events)
          .option("rows_per_second", 10**9).option("max_rows_per_batch", per_batch).option("keys", 16).load())
    q = (fn(df).writeStream.format("onceflow-delta").option("path", f"{root}/out")
         .option("checkpointLocation", f"{root}/ckpt").start())
    while q.isActive and sum(p.numInputRows for p in q.recentProgress) < events:
        time.sleep(0.2)  # stopped once every event went through a batch that completed
    q.stop()
    if q.exception():
        raise SystemExit(f"{fn.__name__}: {q.exception()}")
    timed = [p for p in q.recentProgress if p.numInputRows][1:]
    report = check_delta_table(f"{root}/out", events)
    if not report.ok or report.state_errors:
        raise SystemExit(f"{fn.__name__}: wrong output: {report}")
    return sum(p.numInputRows for p in timed) / (sum(p.durationMs["triggerExecution"] for p in timed) / 1000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--per-batch", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    spark = get_spark("local[2]", "bench-stateful", {
        "spark.sql.streaming.stateStore.providerClass":
            "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"})
    root = tempfile.mkdtemp(prefix="bench-stateful-")
    try:
        best = {name: 0.0 for name in VARIANTS}
        for r in range(args.repeat):
            for name, fn in VARIANTS.items():
                rate = run(spark, fn, args.events, args.per_batch, f"{root}/{name}")
                best[name] = max(best[name], rate)
                print(f"run {r + 1}: {name:28s} {rate:>12,.0f} rows/s", flush=True)
        base = best["applyInPandasWithState"]
        print(f"\n{args.events:,} events, {args.per_batch:,} per batch, 16 keys, RocksDB, onceflow-delta (best of {args.repeat})")
        for name, rate in best.items():
            print(f"{name:28s} {rate:>12,.0f} rows/s   {rate / base:.2f}x")
    finally:
        spark.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
