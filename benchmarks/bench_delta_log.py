"""Cost of the Delta sink's per-batch commit step as a stream ages: local log vs delta-rs.

One command: ``python benchmarks/bench_delta_log.py [--sizes 100,1000,3000] [--commits 50]``.
At each table age (log versions; the table directory holds one attempt directory per batch,
as the JVM path leaves it) the same table takes ``--commits`` batches twice, each a decision
(two add actions and the app transaction) and the clean-up that follows it:

- through delta-rs: refresh the snapshot, then a conditional commit (what onceflow did before
  for every table and still does for object stores);
- through :class:`onceflow.sinks.delta.log.LocalLog`: two ``stat`` calls and a hard link.

No Spark: this is the driver's commit step alone. Prints milliseconds per batch and the ratio;
the table ages between sizes through the local log itself.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql.types import LongType, StructField, StructType
from rich.console import Console
from rich.progress import track

from onceflow.sinks.base import Decision
from onceflow.sinks.delta import DeltaDataSource
from onceflow.sinks.delta import source as delta_source
from onceflow.sinks.delta.files import dir_name

SCHEMA = StructType([StructField("id", LongType())])


def handles(root: str, lineage: str, epoch: int, batch: int) -> list[dict]:
    out = []
    for part in range(2):
        name = f"part-of-{lineage}-e{epoch}-b{batch:010d}-p{part:05d}-a0-{uuid.uuid4().hex[:12]}.parquet"
        pq.write_table(pa.table({"id": pa.array([batch], pa.int64())}), f"{root}/{name}")
        out.append({"path": name, "size": 1, "rows": 1, "mtime": int(time.time() * 1000)})
    return out


def timed(ds: DeltaDataSource, root: str, lineage: str, epoch: int, first: int, count: int) -> float:
    """Milliseconds per batch (decide + clean-up) of batches first..first+count-1 (writing the
    files is not timed)."""
    total = 0.0
    for b in range(first, first + count):
        hs = handles(root, lineage, epoch, b)
        decision = Decision(lineage, b, f"fp-{b}", hs, epoch)
        t = time.perf_counter()
        ds.decide(decision, SCHEMA, False)
        ds.commit(decision)
        total += time.perf_counter() - t
    return total / count * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100,1000,3000", help="log lengths (versions) to measure at")
    ap.add_argument("--commits", type=int, default=50, help="decisions timed per method and size")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="onceflow-bench-log-")
    lineage = str(uuid.uuid4())
    ds = DeltaDataSource({"path": root})
    ds.write_schema = SCHEMA
    epoch = ds.open(lineage)
    batch = 0
    local_log = DeltaDataSource._local_log
    print(f"{'versions':>9} {'delta-rs ms':>12} {'onceflow ms':>12} {'ratio':>7}")
    for size in (int(s) for s in args.sizes.split(",")):
        grow = max(0, size - ds._table().version())
        for _ in track(range(grow), description=f"growing the log to {size}", transient=True,
                       console=Console(stderr=True)):
            os.mkdir(f"{root}/{dir_name(lineage, epoch, batch)}")  # an attempt directory per batch
            ds.decide(Decision(lineage, batch, "fp", [], epoch), SCHEMA, False)
            batch += 1
        DeltaDataSource._local_log = lambda self: None  # type: ignore[method-assign,assignment]
        try:
            rs = timed(ds, root, lineage, epoch, batch, args.commits)
        finally:
            DeltaDataSource._local_log = local_log  # type: ignore[method-assign]
        batch += args.commits
        ours = timed(ds, root, lineage, epoch, batch, args.commits)
        batch += args.commits
        print(f"{size:>9,} {rs:>12.2f} {ours:>12.2f} {rs / ours:>6.1f}x", flush=True)
    delta_source._TABLES.clear()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
