"""``concurrent_writer``: another writer commits to the job's table while the job commits.

For ``--outage-s`` seconds (longer, up to 30 s more, until the job has committed a batch
meanwhile) a writer in the verify process appends small batches of *foreign*
rows to the sink's Delta or Iceberg table, as another job or a user's notebook would: delta-rs
``write_deltalake`` or pyiceberg ``append``; a commit that loses a race (delta-rs refuses an
append beside a MERGE that removed files; pyiceberg fails at once on any concurrent commit) is
tried again on the new version, as a careful writer does. Foreign rows have
negative ids (and keys, for the upsert sinks: no event's key), so they never meet the job's.

The job's commits then race real commits of another writer. The fault requires: every
foreign row the writer saw committed is in the final table exactly once (a sink that
overwrote or rolled back someone else's commit loses them), and the job's own events stay
exactly-once, which the usual check decides after the foreign rows are set aside
(:func:`split_foreign`).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyarrow as pa

from onceflow.verify.fault_base import Fault, Harness

#: foreign rows per commit, and the pause between the writer's commits (seconds)
ROWS_PER_COMMIT, PAUSE_S = 5, 0.2
#: seconds the writer may go on past ``--outage-s`` until the job commits a batch meanwhile
EXTRA_S = 30.0
TABLE_SINKS = ("delta", "delta-jvm", "delta-upsert", "iceberg", "iceberg-upsert")


def _foreign(schema: pa.Schema, ids: np.ndarray) -> pa.Table:
    """Rows of ``schema`` with these (negative) ids: key = id, payload names the writer, every
    other column null."""
    columns: dict[str, Any] = {}
    for f in schema:
        if f.name in ("id", "key"):
            columns[f.name] = pa.array(ids, pa.int64()).cast(f.type)
        elif f.name == "payload":
            columns[f.name] = pa.array([f"foreign{-i}" for i in ids], f.type)
        elif f.name == "checksum":
            columns[f.name] = pa.array(np.zeros(ids.size, np.int64)).cast(f.type)
        else:
            columns[f.name] = pa.nulls(ids.size, f.type)
    return pa.table(columns, schema=schema)


class _Delta:
    def __init__(self, path: str) -> None:
        from deltalake import DeltaTable

        self.path = path
        self.schema = DeltaTable(path).to_pyarrow_dataset().schema

    def append(self, rows: pa.Table) -> None:
        from deltalake import write_deltalake
        from deltalake.exceptions import CommitFailedError

        for _ in range(50):
            try:
                write_deltalake(self.path, rows, mode="append")
                return
            except CommitFailedError:  # delta-rs refuses an append racing the job's MERGE: again
                time.sleep(0.05)
        raise RuntimeError("50 commit conflicts in a row")


class _Iceberg:
    def __init__(self, uri: str, name: str) -> None:
        from pyiceberg.catalog.sql import SqlCatalog

        self.catalog, self.name = SqlCatalog("onceflow", uri=uri), name
        self.schema = self.catalog.load_table(name).schema().as_arrow()

    def append(self, rows: pa.Table) -> None:
        from pyiceberg.exceptions import CommitFailedException

        for _ in range(50):
            try:
                self.catalog.load_table(self.name).append(rows)
                return
            except CommitFailedException:  # the job committed in between: on top of it
                time.sleep(0.05)
        raise RuntimeError("50 commit conflicts in a row")


class ConcurrentWriter(Fault):
    name, help = "concurrent_writer", ("another writer appends rows to the sink's Delta or Iceberg table "
                                       "for --outage-s seconds (longer, until the job committed a batch meanwhile), racing "
                                       "the job's commits")
    stream_s = 60

    def unavailable(self, h: Harness) -> str | None:
        if h.spec.sink not in TABLE_SINKS:
            return f"needs a table sink ({', '.join(TABLE_SINKS)}), not {h.spec.sink}"
        return None

    def inject(self, h: Harness) -> str:
        table = _Iceberg(h.spec.iceberg_catalog, h.spec.table) if h.spec.sink.startswith("iceberg") \
            else _Delta(h.spec.table)
        seq = len(h.events())
        commits, failed, last_error = 0, 0, ""
        started = time.monotonic()
        deadline = started + h.options.outage_s
        # a race needs both writers committing: past --outage-s the writer goes on (at most
        # EXTRA_S more) until the job has committed a batch meanwhile (a job slowed by a kill's
        # recovery or a busy machine had none yet)
        cap = deadline + EXTRA_S
        while (now := time.monotonic()) < deadline or (now < cap and self._job_commits(h, seq) == 0):
            first = len(h.foreign) + 1
            ids = -np.arange(first, first + ROWS_PER_COMMIT, dtype=np.int64)
            try:
                table.append(_foreign(table.schema, ids))
            except Exception as e:  # noqa: BLE001 - a failed foreign commit is reported, not fatal
                failed += 1
                last_error = f"; last failure: {type(e).__name__}: {str(e)[:200]}"
            else:
                h.foreign.extend(ids.tolist())
                commits += 1
            time.sleep(PAUSE_S)
        during = self._job_commits(h, seq)
        return (f"{commits} foreign commits ({commits * ROWS_PER_COMMIT} rows, {failed} failed) for "
                f"{time.monotonic() - started:.0f}s; the job committed {during} batch(es) meanwhile{last_error}")

    @staticmethod
    def _job_commits(h: Harness, seq: int) -> int:
        """The job's batches with rows committed since event ``seq``."""
        return sum(1 for e in h.events()[seq:] if e["event"] == "sink_commit" and e["rows"])


def split_foreign(table: pa.Table, foreign: list[int]) -> tuple[pa.Table, list[str]]:
    """The job's rows (id >= 0), and an anomaly per foreign row the writer committed that is
    missing or present more than once (or present though never committed)."""
    ids = table.column("id").to_numpy(zero_copy_only=False).astype(np.int64)
    mine = ids >= 0
    if mine.all():
        return table, ([f"concurrent_writer: {len(foreign)} committed foreign rows are missing "
                        "(overwritten or rolled back by the job)"] if foreign else [])
    got = -ids[~mine]
    counts = np.bincount(got, minlength=max(-min(foreign), 0) + 1 if foreign else 1)
    want = np.zeros_like(counts)
    want[[-i for i in foreign]] = 1
    missing, extra = int(np.count_nonzero(counts < want)), int((counts - want)[counts > want].sum())
    problems = []
    if missing:
        problems.append(f"concurrent_writer: {missing} of {len(foreign)} committed foreign rows are missing "
                        "(overwritten or rolled back by the job)")
    if extra:
        problems.append(f"concurrent_writer: {extra} foreign rows present more often than committed")
    return table.filter(pa.array(mine)), problems
