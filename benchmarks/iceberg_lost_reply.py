"""Lost commit replies on the Iceberg sink: N trials, each a driver killed right after the catalog
took its batch's snapshot, then a new process that replays the batch. Expect 0 duplicates.

One command: ``python benchmarks/iceberg_lost_reply.py [--trials 100] [--rows 1000]
[--point after_catalog_commit] [--dir D]``.

Each trial i is batch i of one lineage, through the real sink (``onceflow-iceberg`` on a SQLite
catalog, Parquet files, pyiceberg commits) and onceflow's own commit protocol
(:class:`~onceflow.sinks.base.TwoPhaseCommitWriter.commit`), without a Spark JVM so that 100
trials take minutes:

1. a *writer* process (its own session) opens the sink (a new epoch, recovery), pre-commits two
   task files holding ids ``[i*rows, (i+1)*rows)`` and commits batch i with the fault
   ``<point>@i:kill``: at ``after_catalog_commit`` the catalog has accepted the snapshot and the
   process group is SIGKILLed before the commit returns, as when a commit's reply is lost and the
   driver then dies;
2. a *replay* process opens the sink again (a newer epoch; recovery removes orphans of older
   epochs) and runs batch i as a restarted query would: each task asks whether batch i is
   decided (and writes again if not), then the driver commits.

Afterwards an independent reader (pyiceberg's table scan over the Iceberg metadata, not the
sink's code) counts every id: duplicates, missing, and Parquet files in ``data/`` that no
snapshot references. Prints one JSON line; exits 1 on any anomaly.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

TABLE = "lake.lost_reply"


def _sink(root: str, point: str | None, batch: int, markers: str):
    from pyspark.sql.types import LongType, StructField, StructType

    from onceflow import IcebergSink

    schema = StructType([StructField("id", LongType(), False)])
    sink = IcebergSink(f"sqlite:///{root}/catalog.db", TABLE)
    extra = {"allow_unknown_fingerprint": "true", "test_crash_markers": markers,
             "test_crash_at": f"{point}@{batch}:kill" if point else "none"}
    ds = sink.data_source(extra)
    ds.write_schema = schema
    ds.validate(schema, False)
    return ds, schema


def child(role: str, root: str, lineage: str, batch: int, rows: int, point: str) -> None:
    """One process: ``write`` (commit with the fault) or ``replay`` (restarted batch)."""
    import pyarrow as pa

    from onceflow.sinks.base import PreCommitted, TaskInfo, TwoPhaseCommitWriter

    ds, schema = _sink(root, point if role == "write" else None, batch, f"{root}/markers")
    ds.opts["lineage"] = lineage
    ds.open(lineage)
    messages = []
    half = rows // 2
    for part, (lo, hi) in enumerate(((0, half), (half, rows))):
        if ds.is_decided(lineage, batch):  # what TwoPhaseCommitWriter.write asks first
            messages.append(PreCommitted(lineage, batch, part, 0, 0, None, True))
            continue
        ids = pa.array(range(batch * rows + lo, batch * rows + hi), pa.int64())
        table = pa.table({"id": ids}, schema=pa.schema([pa.field("id", pa.int64(), False)]))
        handle, n = ds.pre_commit(TaskInfo(lineage, batch, part, 0), schema, False, iter(table.to_batches()))
        messages.append(PreCommitted(lineage, batch, part, 0, n, handle))
    replay = ds.decision(lineage, batch) is not None
    TwoPhaseCommitWriter(ds, schema, False).commit(messages, batch)
    print(json.dumps({"role": role, "batch": batch, "already_decided": replay}), flush=True)


def check(root: str, total: int) -> dict:
    """The independent count: ids through pyiceberg's scan, files no snapshot references."""
    from pyiceberg.catalog.sql import SqlCatalog

    table = SqlCatalog("onceflow", uri=f"sqlite:///{root}/catalog.db").load_table(TABLE)
    ids = table.scan().to_arrow().column("id").to_pylist()
    counts = collections.Counter(ids)
    live = {p.rsplit("/", 1)[-1] for p in table.inspect.files().column("file_path").to_pylist()}
    data = os.path.join(table.location().removeprefix("file://"), "data")
    dangling = sorted(n for n in os.listdir(data) if n.endswith(".parquet") and n not in live)
    return {"rows": len(ids), "duplicates": sum(c - 1 for c in counts.values() if c > 1),
            "missing": len(set(range(total)) - set(counts)), "dangling_files": len(dangling),
            "snapshots": len(table.metadata.snapshots)}


def run(trials: int, rows: int, point: str, root: str) -> dict:
    os.makedirs(f"{root}/markers", exist_ok=True)
    lineage = str(uuid.uuid4())
    killed = lost_replies = 0
    started = time.monotonic()
    for batch in range(trials):
        base = [sys.executable, __file__, "--child", "", "--dir", root, "--lineage", lineage,
                "--batch", str(batch), "--rows", str(rows), "--point", point]
        base[3] = "write"
        w = subprocess.run(base, start_new_session=True, capture_output=True, text=True, timeout=300)
        fired = os.path.exists(f"{root}/markers/fired-{point}-{batch}")
        if w.returncode != -9 or not fired:
            raise SystemExit(f"trial {batch}: the writer was not killed at {point} "
                             f"(exit {w.returncode}):\n{w.stderr[-3000:]}")
        killed += 1
        base[3] = "replay"
        r = subprocess.run(base, start_new_session=True, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise SystemExit(f"trial {batch}: the replay failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
        lost_replies += json.loads(r.stdout.strip().splitlines()[-1])["already_decided"]
    report = {"trials": trials, "rows_per_batch": rows, "point": point, "writers_killed": killed,
              "replays_that_found_their_batch_decided": lost_replies,
              "seconds": round(time.monotonic() - started, 1), **check(root, trials * rows)}
    report["ok"] = report["duplicates"] == 0 and report["missing"] == 0 and report["dangling_files"] == 0
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--rows", type=int, default=1000)
    p.add_argument("--point", default="after_catalog_commit")
    p.add_argument("--dir", default=None, help="work directory (default: a new temporary one, removed)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--lineage", default=None, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.child, a.dir, a.lineage, a.batch, a.rows, a.point)
        return
    root = a.dir or tempfile.mkdtemp(prefix="iceberg-lost-reply-")
    try:
        report = run(a.trials, a.rows, a.point, os.path.abspath(root))
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(report))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
