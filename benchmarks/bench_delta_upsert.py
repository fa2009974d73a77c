"""Delta upsert: onceflow's exactly-once MERGE per batch vs a hand-written delta-rs MERGE.

One command: ``python benchmarks/bench_delta_upsert.py [--table-rows 10000000]
[--per-batch 1000000] [--batches 3]``.

Both start from copies of one table of ``--table-rows`` rows (``k`` = 0..N-1, ``seq``, ``v``) and
merge ``--batches`` batches of ``--per-batch`` events each, keyed by ``k = (value * 2654435761)
mod 2N`` (a bijection: every event of a batch has its own key, about half of them in the table
already, spread over every file):

- **delta-rs by hand**: the batch built in Python (numpy), then ``DeltaTable.merge`` with
  ``t.k = s.k``, update all / insert all, as a user would write it in ``foreachBatch``, with no
  deduplication, no fencing and no exactly-once;
- **onceflow**: Spark's ``rate-micro-batch`` source at ``--per-batch`` rows per batch into
  ``writeStream.format("onceflow-delta")`` with ``write=upsert``, ``keys=k``, ``order_by=seq``:
  tasks stage the batch, the driver reduces it to one event per key and MERGEs it with the
  batch's app transaction. Its time per batch is Spark's trigger execution time (staging,
  deduplication, MERGE, commit).

Prints the seconds per batch of each (batch 0 of the query, which pays the query's start, is
not timed) and their ratio, measured in the same run, and checks both tables' row counts;
then the pieces onceflow adds to the MERGE (staging, reading back, deduplication), each timed
alone on the same batches: the profile of the difference.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import numpy as np
import pyarrow as pa

MULT = 2654435761


def base_table(path: str, rows: int) -> None:
    from deltalake import write_deltalake

    step = 2_000_000
    for lo in range(0, rows, step):
        k = np.arange(lo, min(rows, lo + step), dtype=np.int64)
        write_deltalake(path, pa.table({"k": k, "seq": np.full(k.size, -1, np.int64),
                                        "v": pa.array(np.char.add("init", k.astype(str)))}),
                        mode="append")


def batch_rows(b: int, per_batch: int, keyspace: int) -> pa.Table:
    value = np.arange(b * per_batch, (b + 1) * per_batch, dtype=np.int64)
    return pa.table({"k": (value * MULT) % keyspace, "seq": value, "v": pa.array(np.char.add("v", value.astype(str)))})


def by_hand(path: str, batches: int, per_batch: int, keyspace: int) -> list[float]:
    from deltalake import DeltaTable

    times = []
    for b in range(1, batches + 1):  # the same batches onceflow times (1..batches)
        src = batch_rows(b, per_batch, keyspace)
        t0 = time.perf_counter()
        (DeltaTable(path).merge(src, "t.k = s.k", source_alias="s", target_alias="t")
         .when_matched_update_all().when_not_matched_insert_all().execute())
        times.append(time.perf_counter() - t0)
    return times


def pieces(root: str, batches: int, per_batch: int, keyspace: int) -> dict[str, float]:
    """The work onceflow adds to a MERGE, each piece timed alone on the same batches (median
    seconds): staging the batch as two tasks' Parquet files, reading them back in the driver,
    and reducing them to the last event per key."""
    import pyarrow.parquet as pq

    from onceflow.sinks.upserts import last_per_key

    times: dict[str, list[float]] = {"stage (tasks write Parquet)": [], "read staged": [], "last event per key": []}
    for b in range(1, batches + 1):
        rows, half = batch_rows(b, per_batch, keyspace), per_batch // 2
        t0 = time.perf_counter()
        pq.write_table(rows.slice(0, half), f"{root}/s0.parquet")
        pq.write_table(rows.slice(half), f"{root}/s1.parquet")
        t1 = time.perf_counter()
        staged = pa.concat_tables([pq.read_table(f"{root}/s{i}.parquet") for i in (0, 1)]).combine_chunks()
        t2 = time.perf_counter()
        last_per_key(staged, ["k"], "seq")
        t3 = time.perf_counter()
        for name, t in zip(times, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            times[name].append(t)
    return {name: float(np.median(t)) for name, t in times.items()}


def onceflow(path: str, ckpt: str, batches: int, per_batch: int, keyspace: int) -> list[float]:
    from onceflow.spark import get_spark, query_conf, register_all

    spark = get_spark("local[2]", "bench-delta-upsert")
    register_all(spark)
    df = (spark.readStream.format("rate-micro-batch").option("rowsPerBatch", per_batch).option("numPartitions", 2)
          .load().selectExpr(f"pmod(value * {MULT}, {keyspace}) AS k", "value AS seq", "concat('v', value) AS v"))
    writer = (df.writeStream.format("onceflow-delta").option("path", path).option("write", "upsert")
              .option("keys", "k").option("order_by", "seq").option("checkpointLocation", ckpt)
              .trigger(processingTime="1 second"))
    with query_conf(spark, ckpt):
        q = writer.start()
    # batches 0..batches done (a new trigger may already run: its progress is not timed)
    while (q.lastProgress or {}).get("batchId", -1) < batches:
        if q.exception():
            raise SystemExit(f"onceflow: {q.exception()}")
        time.sleep(0.05)
    q.stop()
    progress = {p.batchId: p.durationMs["triggerExecution"] / 1000 for p in q.recentProgress if p.numInputRows}
    spark.stop()
    return [progress[b] for b in range(1, batches + 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table-rows", type=int, default=10_000_000)
    ap.add_argument("--per-batch", type=int, default=1_000_000)
    ap.add_argument("--batches", type=int, default=3)
    a = ap.parse_args()
    from deltalake import DeltaTable

    root = tempfile.mkdtemp(prefix="bench-delta-upsert-")
    keyspace = 2 * a.table_rows
    try:
        t0 = time.perf_counter()
        base_table(f"{root}/base", a.table_rows)
        print(f"base table: {a.table_rows:,} rows in {time.perf_counter() - t0:.1f} s", flush=True)
        shutil.copytree(f"{root}/base", f"{root}/hand")
        shutil.copytree(f"{root}/base", f"{root}/onceflow")
        # onceflow's batch 0 (untimed, the query's start) merges batch 0's keys: the hand run too
        first = batch_rows(0, a.per_batch, keyspace)
        (DeltaTable(f"{root}/hand").merge(first, "t.k = s.k", source_alias="s", target_alias="t")
         .when_matched_update_all().when_not_matched_insert_all().execute())
        hand = by_hand(f"{root}/hand", a.batches, a.per_batch, keyspace)
        ours = onceflow(f"{root}/onceflow", f"{root}/ckpt", a.batches, a.per_batch, keyspace)
        counts = {n: DeltaTable(f"{root}/{n}").to_pyarrow_dataset().count_rows() for n in ("hand", "onceflow")}
        if counts["hand"] != counts["onceflow"]:
            raise SystemExit(f"row counts differ: {counts}")
        med_h, med_o = float(np.median(hand)), float(np.median(ours))
        print(f"{a.per_batch:,} keys per batch into {a.table_rows:,} rows ({counts['hand']:,} after), "
              f"{a.batches} timed batches")
        print(f"  delta-rs MERGE by hand : {', '.join(f'{t:.2f}' for t in hand)} s per batch (median {med_h:.2f})")
        print(f"  onceflow upsert        : {', '.join(f'{t:.2f}' for t in ours)} s per batch (median {med_o:.2f})")
        print(f"  ratio onceflow / by hand: {med_o / med_h:.2f}x time per batch")
        parts = pieces(root, a.batches, a.per_batch, keyspace)
        print("  where the difference goes (each piece alone, median s): "
              + ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
              + f"; sum {sum(parts.values()):.2f} against a difference of {med_o - med_h:.2f} "
              "(the rest: Spark's micro-batch, the Arrow transfer to the Python tasks)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
