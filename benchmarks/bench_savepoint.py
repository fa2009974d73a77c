"""Savepoint create + restore time vs a plain recursive copy of the same files.

    python benchmarks/bench_savepoint.py [--keys 1000000 10000000] [--backend hashmap|rocksdb]
                                         [--work DIR] [--repeat 3]

For each key count, a stateful job (groupBy(key).count(), one key per event) runs once to
build a checkpoint whose state holds that many keys (cached in --work between runs). Then,
best of --repeat, it times: ``create_savepoint`` (select + copy + SHA-256 + manifest),
``RestoreRequest.apply`` (verify size + SHA-256 while copying into an empty checkpoint),
and ``shutil.copytree`` of the savepoint's own checkpoint/ directory (the same files, no
checksums). Target: each of create and restore <= 1.5x the plain copy.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time


def build(work: str, keys: int, backend: str) -> str:
    ckpt = f"{work}/{backend}-{keys}/ckpt"
    if os.path.exists(f"{ckpt}/commits/0") or os.path.exists(f"{ckpt}/commits/1"):
        return ckpt
    shutil.rmtree(f"{work}/{backend}-{keys}", ignore_errors=True)
    from onceflow import CheckpointConfig, DeltaSink, Job, fixed_delay, get_spark

    # HDFS-backed state lives on the heap: 10M keys need more than Spark's default 1 GiB.
    spark = get_spark("local[2]", "bench-savepoint", {"spark.driver.memory": os.environ.get("BENCH_DRIVER_MEMORY", "8g")})

    def source(spark):
        return (spark.readStream.format("onceflow-sequence").option("total", keys)
                .option("rows_per_second", 1_000_000_000).option("keys", keys)
                .option("max_rows_per_batch", keys).load())

    job = Job(name=f"bench-{keys}", source=source, transform=lambda df: df.groupBy("key").count(),
              sink=DeltaSink(f"{work}/{backend}-{keys}/table", mode="complete"), output_mode="complete",
              checkpoint=CheckpointConfig(ckpt, interval=0, state_backend=backend),
              restart_strategy=fixed_delay(attempts=1, delay=0), stop_when_idle=1.0)
    t = time.monotonic()
    job.run(spark=spark)
    print(f"  built state of {keys:,} keys ({backend}) in {time.monotonic() - t:.1f}s", flush=True)
    return ckpt


def du(path: str) -> tuple[int, int]:
    n = size = 0
    for d, _, files in os.walk(path):
        for f in files:
            n += 1
            size += os.path.getsize(os.path.join(d, f))
    return n, size


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--backend", choices=["hashmap", "rocksdb"], default="hashmap")
    ap.add_argument("--work", default="/tmp/onceflow-bench-savepoint")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from onceflow.savepoint import RestoreRequest, create_savepoint

    os.makedirs(args.work, exist_ok=True)
    print(f"{'keys':>12} {'files':>6} {'MiB':>8} {'copy s':>8} {'create s':>9} {'restore s':>10} "
          f"{'create/copy':>12} {'restore/copy':>13} {'(c+r)/2copy':>12}")
    results = []
    for keys in args.keys:
        ckpt = build(args.work, keys, args.backend)
        runs = {"copy": [], "create": [], "restore": []}
        base = f"{args.work}/{args.backend}-{keys}"
        for _ in range(args.repeat):
            for d in ("sp", "copy", "restored"):
                shutil.rmtree(f"{base}/{d}", ignore_errors=True)
            t = time.monotonic()
            create_savepoint(ckpt, f"{base}/sp")
            runs["create"].append(time.monotonic() - t)
            t = time.monotonic()
            shutil.copytree(f"{base}/sp/checkpoint", f"{base}/copy")
            runs["copy"].append(time.monotonic() - t)
            t = time.monotonic()
            RestoreRequest(f"{base}/sp").apply(f"{base}/restored")
            runs["restore"].append(time.monotonic() - t)
        files, size = du(f"{base}/copy")
        c, cr, r = (min(runs[k]) for k in ("copy", "create", "restore"))
        results.append((keys, cr / c, r / c))
        print(f"{keys:>12,} {files:>6} {size / 2**20:>8.1f} {c:>8.3f} {cr:>9.3f} {r:>10.3f} "
              f"{cr / c:>11.2f}x {r / c:>12.2f}x {(cr + r) / (2 * c):>11.2f}x   "
              f"(median copy {statistics.median(runs['copy']):.3f}s)", flush=True)
        for d in ("sp", "copy", "restored"):
            shutil.rmtree(f"{base}/{d}", ignore_errors=True)
    ok = all(a <= 1.5 and b <= 1.5 for _, a, b in results)
    print("target (create and restore each <= 1.5x the copy):", "met" if ok else "NOT met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
