"""Lost commit replies on the Delta sink, append or upsert: N trials, each a writer killed right
after its batch's commit reached the Delta log, then a new process that replays the batch.

One command: ``python benchmarks/delta_lost_reply.py [--write append|upsert] [--trials 100]
[--rows 1000] [--dir D]``.

Trial i is batch i of one lineage, through the real sink (``onceflow-delta`` on a local table,
delta-rs) and onceflow's own commit protocol (:meth:`TwoPhaseCommitWriter.commit`), without a
Spark JVM so that 100 trials take minutes:

1. a *writer* process (its own session) opens the sink (a new epoch, recovery), pre-commits two
   task files of batch i and commits it with the fault ``after_decide@i:kill``: the log entry
   that decides the batch (an append's add actions, or an upsert's MERGE) is written, and the
   process group is SIGKILLed before the commit returns, as when the reply is lost and the
   driver then dies;
2. a *replay* process opens the sink again (a newer epoch) and runs batch i as a restarted
   query would: each task asks whether batch i is decided (and writes again if not), then the
   driver commits.

Rows: append writes ids ``[i*rows, (i+1)*rows)``. Upsert writes the same ids as events of key
``id % rows`` (each batch updates every key once, so a batch merged again after a later one
would bring old values back) and every 11th event deletes its key.

Afterwards independent readers (delta-rs over the log, and the raw JSON log; not the sink's code)
check: append, every id once; upsert, every key at its last event or deleted by it, and exactly
one MERGE per batch in the log. Plus files in the table directory the log never mentions.
Prints one JSON line; exits 1 on any anomaly.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid


def _schema(write: str):
    from pyspark.sql.types import BooleanType, LongType, StructField, StructType

    fields = [StructField("id", LongType(), False)]
    if write == "upsert":
        fields += [StructField("k", LongType(), False), StructField("_onceflow_delete", BooleanType(), False)]
    return StructType(fields)


def _sink(root: str, write: str, point: str | None, batch: int):
    from onceflow import DeltaSink

    # delete_when is evaluated by Spark in a Job; here the tasks get its flag column directly
    sink = DeltaSink(f"{root}/table", write=write, **({"keys": ["k"], "order_by": "id", "delete_when": "op = 'd'"}
                                                       if write == "upsert" else {}))
    extra = {"allow_unknown_fingerprint": "true", "test_crash_markers": f"{root}/markers",
             "test_crash_at": f"{point}@{batch}:kill" if point else "none"}
    ds = sink.data_source(extra)
    schema = _schema(write)
    ds.write_schema = schema
    ds.validate(schema, False)
    return ds, schema


def _rows(write: str, batch: int, lo: int, hi: int, rows: int):
    import pyarrow as pa

    ids = pa.array(range(batch * rows + lo, batch * rows + hi), pa.int64())
    cols = {"id": ids}
    if write == "upsert":
        cols |= {"k": pa.array([i % rows for i in ids.to_pylist()], pa.int64()),
                 "_onceflow_delete": pa.array([i % 11 == 5 for i in ids.to_pylist()])}
    return pa.table(cols)


def child(role: str, root: str, write: str, lineage: str, batch: int, rows: int) -> None:
    """One process: ``write`` (commit with the fault) or ``replay`` (restarted batch)."""
    from onceflow.sinks.base import PreCommitted, TaskInfo, TwoPhaseCommitWriter

    ds, schema = _sink(root, write, "after_decide" if role == "write" else None, batch)
    ds.opts["lineage"] = lineage
    ds.open(lineage)
    messages = []
    half = rows // 2
    for part, (lo, hi) in enumerate(((0, half), (half, rows))):
        if ds.is_decided(lineage, batch):  # what TwoPhaseCommitWriter.write asks first
            messages.append(PreCommitted(lineage, batch, part, 0, 0, None, True))
            continue
        table = _rows(write, batch, lo, hi, rows)
        handle, n = ds.pre_commit(TaskInfo(lineage, batch, part, 0), schema, False, iter(table.to_batches()))
        messages.append(PreCommitted(lineage, batch, part, 0, n, handle))
    replay = ds.decision(lineage, batch) is not None
    TwoPhaseCommitWriter(ds, schema, False).commit(messages, batch)
    print(json.dumps({"role": role, "batch": batch, "already_decided": replay}), flush=True)


def check(root: str, write: str, trials: int, rows: int) -> dict:
    """Independent: delta-rs's read of the table, and the raw JSON log."""
    from deltalake import DeltaTable

    from onceflow.verify.readers import delta_dangling

    table = f"{root}/table"
    got = DeltaTable(table).to_pyarrow_table().to_pylist()
    out = {"rows": len(got), "dangling_files": len(delta_dangling(table))}
    if write == "append":
        counts = collections.Counter(r["id"] for r in got)
        out |= {"duplicates": sum(c - 1 for c in counts.values() if c > 1),
                "missing": len(set(range(trials * rows)) - set(counts))}
        return out
    merges: collections.Counter = collections.Counter()
    for entry in sorted(glob.glob(f"{table}/_delta_log/*.json")):
        for action in map(json.loads, open(entry)):
            info = action.get("commitInfo") or {}
            if info.get("operation") == "MERGE" and info.get("onceflow"):
                merges[json.loads(info["onceflow"])["batch"]] += 1
    want = {}
    for k in range(rows):
        last = (trials - 1) * rows + k
        if last % 11 != 5:
            want[k] = last
    held = collections.Counter(r["k"] for r in got)
    by_key = {r["k"]: r["id"] for r in got}
    out |= {"duplicates": sum(c - 1 for c in held.values() if c > 1),
            "missing": sum(1 for k, i in want.items() if by_key.get(k) != i),
            "deleted_present": sum(1 for k in by_key if k not in want),
            "batches_merged_twice": sum(1 for n in merges.values() if n > 1),
            "batches_never_merged": trials - len(merges)}
    return out


def run(write: str, trials: int, rows: int, root: str) -> dict:
    os.makedirs(f"{root}/markers", exist_ok=True)
    lineage = str(uuid.uuid4())
    killed = lost_replies = 0
    started = time.monotonic()
    for batch in range(trials):
        base = [sys.executable, __file__, "--child", "write", "--dir", root, "--write", write,
                "--lineage", lineage, "--batch", str(batch), "--rows", str(rows)]
        w = subprocess.run(base, start_new_session=True, capture_output=True, text=True, timeout=300)
        if w.returncode != -9 or not os.path.exists(f"{root}/markers/fired-after_decide-{batch}"):
            raise SystemExit(f"trial {batch}: the writer was not killed after its decision "
                             f"(exit {w.returncode}):\n{w.stderr[-3000:]}")
        killed += 1
        base[3] = "replay"
        r = subprocess.run(base, start_new_session=True, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise SystemExit(f"trial {batch}: the replay failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
        lost_replies += json.loads(r.stdout.strip().splitlines()[-1])["already_decided"]
        if (batch + 1) % 10 == 0:
            print(f"{batch + 1}/{trials} trials", file=sys.stderr, flush=True)
    report = {"write": write, "trials": trials, "rows_per_batch": rows, "writers_killed": killed,
              "replays_that_found_their_batch_decided": lost_replies,
              "seconds": round(time.monotonic() - started, 1), **check(root, write, trials, rows)}
    bad = ("duplicates", "missing", "dangling_files", "deleted_present", "batches_merged_twice",
           "batches_never_merged")
    report["ok"] = not any(report.get(k) for k in bad) and lost_replies == trials
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", choices=("append", "upsert"), default="append")
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--rows", type=int, default=1000)
    p.add_argument("--dir", default=None, help="work directory (default: a new temporary one, removed)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--lineage", default=None, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.child, a.dir, a.write, a.lineage, a.batch, a.rows)
        return
    root = a.dir or tempfile.mkdtemp(prefix="delta-lost-reply-")
    try:
        report = run(a.write, a.trials, a.rows, os.path.abspath(root))
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(report))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
