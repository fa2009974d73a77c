"""Lost commit replies on the Iceberg sink: N trials, each a driver killed right after the catalog
took its batch's snapshot, then a new process that replays the batch. Expect 0 duplicates.

One command: ``python benchmarks/iceberg_lost_reply.py [--trials 100] [--rows 1000]
[--write append|upsert] [--point after_catalog_commit] [--dir D]``.

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

``--write upsert``: the sink upserts on ``id`` (``delete_when``'s flag column set by the
trial). Batch i inserts the new keys ``[i*rows, (i+1)*rows)`` (value i) and, for the keys of
batch i-1, updates the first tenth to value i and deletes the second tenth. The reader then
also compares every key's value with a model of the batches applied once each: ``wrong``
counts keys with another value, ``resurrected`` deleted keys that are present, and
``applied_twice`` batches decided by more than one snapshot (a second application of an
upsert batch would not change the rows, so the snapshot history is checked too).
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
FLAG = "_onceflow_delete"  # the column IcebergSink(delete_when=...) has Spark compute


def _sink(root: str, point: str | None, batch: int, markers: str, write: str):
    from pyspark.sql.types import BooleanType, LongType, StructField, StructType

    from onceflow import IcebergSink

    if write == "upsert":
        schema = StructType([StructField("id", LongType(), False), StructField("v", LongType(), False),
                             StructField(FLAG, BooleanType(), False)])
        sink = IcebergSink(f"sqlite:///{root}/catalog.db", TABLE, write="upsert", keys=["id"],
                           delete_when=FLAG)
    else:
        schema = StructType([StructField("id", LongType(), False)])
        sink = IcebergSink(f"sqlite:///{root}/catalog.db", TABLE)
    extra = {"allow_unknown_fingerprint": "true", "test_crash_markers": markers,
             "test_crash_at": f"{point}@{batch}:kill" if point else "none"}
    ds = sink.data_source(extra)
    ds.write_schema = schema
    ds.validate(schema, False)
    return ds, schema


def upsert_events(batch: int, rows: int) -> list[tuple[list[int], list[int], list[bool]]]:
    """Batch i's two task partitions of (ids, values, delete flags), see the module doc."""
    half, tenth = rows // 2, rows // 10
    new = list(range(batch * rows, (batch + 1) * rows))
    p0 = (new[:half], [batch] * half, [False] * half)
    ids, vals, dels = new[half:], [batch] * (rows - half), [False] * (rows - half)
    if batch > 0:
        prev = (batch - 1) * rows
        ids += list(range(prev, prev + 2 * tenth))
        vals += [batch] * (2 * tenth)
        dels += [False] * tenth + [True] * tenth
    return [p0, (ids, vals, dels)]


def model(trials: int, rows: int) -> dict[int, int]:
    """Each key's value after batches 0..trials-1, each applied once."""
    state: dict[int, int] = {}
    for b in range(trials):
        for ids, vals, dels in upsert_events(b, rows):
            for i, v, d in zip(ids, vals, dels, strict=True):
                if d:
                    state.pop(i, None)
                else:
                    state[i] = v
    return state


def child(role: str, root: str, lineage: str, batch: int, rows: int, point: str, write: str) -> None:
    """One process: ``write`` (commit with the fault) or ``replay`` (restarted batch)."""
    import pyarrow as pa

    from onceflow.sinks.base import PreCommitted, TaskInfo, TwoPhaseCommitWriter

    ds, schema = _sink(root, point if role == "write" else None, batch, f"{root}/markers", write)
    ds.opts["lineage"] = lineage
    ds.open(lineage)
    messages = []
    half = rows // 2
    parts = upsert_events(batch, rows) if write == "upsert" else [
        (list(range(batch * rows + lo, batch * rows + hi)),) for lo, hi in ((0, half), (half, rows))]
    arrow = pa.schema([pa.field("id", pa.int64(), False), pa.field("v", pa.int64(), False),
                       pa.field(FLAG, pa.bool_(), False)][:3 if write == "upsert" else 1])
    for part, cols in enumerate(parts):
        if ds.is_decided(lineage, batch):  # what TwoPhaseCommitWriter.write asks first
            messages.append(PreCommitted(lineage, batch, part, 0, 0, None, True))
            continue
        table = pa.table(list(cols), schema=arrow)
        handle, n = ds.pre_commit(TaskInfo(lineage, batch, part, 0), schema, False, iter(table.to_batches()))
        messages.append(PreCommitted(lineage, batch, part, 0, n, handle))
    replay = ds.decision(lineage, batch) is not None
    TwoPhaseCommitWriter(ds, schema, False).commit(messages, batch)
    print(json.dumps({"role": role, "batch": batch, "already_decided": replay}), flush=True)


def check(root: str, trials: int, rows: int, write: str) -> dict:
    """The independent count: ids through pyiceberg's scan (not the sink's code), files no
    snapshot references, and (upsert) every key's value against :func:`model`."""
    from pyiceberg.catalog.sql import SqlCatalog

    table = SqlCatalog("onceflow", uri=f"sqlite:///{root}/catalog.db").load_table(TABLE)
    got = table.scan().to_arrow()
    ids = got.column("id").to_pylist()
    counts = collections.Counter(ids)
    live = {p.rsplit("/", 1)[-1] for p in table.inspect.all_files().column("file_path").to_pylist()}
    data = os.path.join(table.location().removeprefix("file://"), "data")
    dangling = sorted(n for n in os.listdir(data) if n.endswith(".parquet") and n not in live)
    decided = collections.Counter(s.summary.additional_properties.get("onceflow.batch")
                                  for s in table.metadata.snapshots if s.summary is not None)
    out = {"rows": len(ids), "duplicates": sum(c - 1 for c in counts.values() if c > 1),
           "dangling_files": len(dangling), "snapshots": len(table.metadata.snapshots),
           "applied_twice": sum(1 for b, n in decided.items() if b is not None and n > 1)}
    if write == "upsert":
        want = model(trials, rows)
        have = dict(zip(ids, got.column("v").to_pylist(), strict=True))
        gone = set(range(trials * rows)) - set(want)
        out |= {"missing": len(set(want) - set(have)), "wrong": sum(1 for k in want if k in have and have[k] != want[k]),
                "resurrected": len(gone & set(have)), "deleted_keys": len(gone)}
    else:
        out["missing"] = len(set(range(trials * rows)) - set(counts))
    return out


def run(trials: int, rows: int, point: str, root: str, write: str) -> dict:
    os.makedirs(f"{root}/markers", exist_ok=True)
    lineage = str(uuid.uuid4())
    killed = lost_replies = 0
    started = time.monotonic()
    for batch in range(trials):
        base = [sys.executable, __file__, "--child", "", "--dir", root, "--lineage", lineage,
                "--batch", str(batch), "--rows", str(rows), "--point", point, "--write", write]
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
    report = {"trials": trials, "write": write, "rows_per_batch": rows, "point": point, "writers_killed": killed,
              "replays_that_found_their_batch_decided": lost_replies,
              "seconds": round(time.monotonic() - started, 1), **check(root, trials, rows, write)}
    bad = ("duplicates", "missing", "dangling_files", "applied_twice", "wrong", "resurrected")
    report["ok"] = not any(report.get(k) for k in bad)
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--rows", type=int, default=1000)
    p.add_argument("--point", default="after_catalog_commit")
    p.add_argument("--write", choices=("append", "upsert"), default="append")
    p.add_argument("--dir", default=None, help="work directory (default: a new temporary one, removed)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--lineage", default=None, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.child, a.dir, a.lineage, a.batch, a.rows, a.point, a.write)
        return
    root = a.dir or tempfile.mkdtemp(prefix="iceberg-lost-reply-")
    try:
        report = run(a.trials, a.rows, a.point, os.path.abspath(root), a.write)
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(report))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
