"""Savepoint create + restore time vs a plain recursive copy of the same files.

    python benchmarks/bench_savepoint.py [--keys 1000000 10000000] [--backend hashmap|rocksdb]
                                         [--work DIR] [--repeat 3]

For each key count, a stateful job (groupBy(key).count(), one key per event) runs once to
build a checkpoint whose state holds that many keys (cached in --work between runs). Then,
best of --repeat, it times (no Spark is started for these):

* ``create_savepoint`` (select + copy + SHA-256 + manifest) against a plain copy of the same
  files from the same source (``shutil.copy2`` of each file the savepoint holds, read from
  the checkpoint);
* ``RestoreRequest.apply`` (size check, SHA-256 verified while copying, restore marker)
  against ``shutil.copytree`` of the savepoint's ``checkpoint/`` directory (same source).

Each timed operation and its baseline run back to back on a page cache warmed by the
previous round, or, with ``--cold`` (root only), after dropping the page cache each time. Target: create and restore each <= 1.5x its
copy. The script prints whether the target was met; it always exits 0.
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


def cold(enabled: bool) -> None:
    """Flush dirty pages and drop the page cache (untimed), so the next read hits the disk."""
    if enabled:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--backend", choices=["hashmap", "rocksdb"], default="hashmap")
    ap.add_argument("--work", default="/tmp/onceflow-bench-savepoint")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cold", action="store_true",
                    help="drop the page cache before every timed operation (needs root): source "
                         "files are read from disk, as after a restart or on another machine")
    args = ap.parse_args()
    if args.cold and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        print("--cold needs root (it writes /proc/sys/vm/drop_caches)", file=sys.stderr)
        return 2
    from onceflow.checkpoint.layout import CheckpointDir
    from onceflow.savepoint import RestoreRequest, create_savepoint, read_manifest

    os.makedirs(args.work, exist_ok=True)
    print(f"{'keys':>12} {'files':>6} {'MiB':>8} {'copy1 s':>8} {'create s':>9} {'copy2 s':>8} "
          f"{'restore s':>10} {'create/copy1':>13} {'restore/copy2':>14}")
    results = []
    for keys in args.keys:
        ckpt = build(args.work, keys, args.backend)
        runs: dict[str, list[float]] = {"copy1": [], "create": [], "copy2": [], "restore": []}
        base = f"{args.work}/{args.backend}-{keys}"
        src = CheckpointDir(ckpt).path
        for _ in range(args.repeat):
            for d in ("sp", "copy1", "copy2", "restored"):
                shutil.rmtree(f"{base}/{d}", ignore_errors=True)
            cold(args.cold)
            t = time.perf_counter()
            create_savepoint(ckpt, f"{base}/sp")
            runs["create"].append(time.perf_counter() - t)
            rels = [f.path.split("/", 1)[1] for f in read_manifest(f"{base}/sp").files]
            cold(args.cold)
            t = time.perf_counter()
            for rel in rels:  # the same files from the same place, without checksums
                os.makedirs(os.path.dirname(f"{base}/copy1/{rel}"), exist_ok=True)
                shutil.copy2(f"{src}/{rel}", f"{base}/copy1/{rel}")
            runs["copy1"].append(time.perf_counter() - t)
            cold(args.cold)
            t = time.perf_counter()
            RestoreRequest(f"{base}/sp").apply(f"{base}/restored")
            runs["restore"].append(time.perf_counter() - t)
            cold(args.cold)
            t = time.perf_counter()
            shutil.copytree(f"{base}/sp/checkpoint", f"{base}/copy2")
            runs["copy2"].append(time.perf_counter() - t)
        files, size = du(f"{base}/copy2")
        c1, cr, c2, r = (min(runs[k]) for k in ("copy1", "create", "copy2", "restore"))
        results.append((keys, cr / c1, r / c2))
        print(f"{keys:>12,} {files:>6} {size / 2**20:>8.1f} {c1:>8.3f} {cr:>9.3f} {c2:>8.3f} {r:>10.3f} "
              f"{cr / c1:>12.2f}x {r / c2:>13.2f}x   (medians: copy1 {statistics.median(runs['copy1']):.3f}s, "
              f"create {statistics.median(runs['create']):.3f}s, copy2 {statistics.median(runs['copy2']):.3f}s, "
              f"restore {statistics.median(runs['restore']):.3f}s)", flush=True)
        for d in ("sp", "copy1", "copy2", "restored"):
            shutil.rmtree(f"{base}/{d}", ignore_errors=True)
    ok = all(a <= 1.5 and b <= 1.5 for _, a, b in results)
    cache = "cold page cache" if args.cold else "warm page cache"
    print(f"target (create and restore each <= 1.5x the copy), {cache}:", "met" if ok else "NOT met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
