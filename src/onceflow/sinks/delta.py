"""Exactly-once Delta Lake sink on delta-rs (no JVM jars).

Tasks write Parquet files into the table directory (invisible: not in the Delta log). The
driver commits one Delta version with every add action and an app transaction
``onceflow-<sink>-<lineage>`` at version = batch id: decision and commit are one atomic
log write, so the crash windows "after decide" and "mid-commit" cannot occur. A replayed
batch finds the app transaction and writes nothing. Files of failed or speculative attempts
are deleted after the batch commits and on recovery.

Modes: ``append`` adds the batch's rows; ``complete`` replaces the table's contents with the
batch's result in the same single commit. Guarantee for both: exactly-once.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import TableNotFoundError
from deltalake.transaction import AddAction, create_table_with_add_actions
from fsspec.core import url_to_fs
from pyspark.sql.pandas.types import to_arrow_schema as _to_arrow_schema
from pyspark.sql.types import StructType

from onceflow.errors import ConfigError, SinkError
from onceflow.faults import maybe_crash
from onceflow.sinks.base import Decision, Sink, TaskInfo, TwoPhaseCommitSink

_FILE = re.compile(r"^part-of-(?P<lineage>[0-9a-f-]{36})-b(?P<batch>\d+)-p(?P<part>\d+)-a(?P<att>\d+)-[0-9a-f]+\.parquet$")


def to_arrow_schema(schema: StructType) -> pa.Schema:
    """Spark schema -> Arrow schema as Spark's Arrow batches carry it (timestamps in UTC)."""
    return _to_arrow_schema(schema, timezone="UTC")


def _file_name(task: TaskInfo) -> str:
    return (
        f"part-of-{task.lineage}-b{task.batch_id:010d}-p{task.partition:05d}"
        f"-a{task.attempt}-{uuid.uuid4().hex[:12]}.parquet"
    )


class DeltaDataSource(TwoPhaseCommitSink):
    """``df.writeStream.format("onceflow-delta").option("path", URL)``."""

    format_name = "onceflow-delta"
    atomic_decide_commit = True
    required_options = ("path",)
    options_doc = {
        "path": "table URL (created on the first commit if it does not exist)",
        "sink_id": "name of this sink within the job, part of the app id (default 'delta')",
        "mode": "append or complete (replace the table each batch); default: the query's output mode",
        "row_group_rows": "rows per Parquet row group (default 1000000)",
    }

    def __init__(self, options):
        super().__init__(options)
        self.table_url = self.opts["path"].rstrip("/")
        self.sink_id = self.opts.get("sink_id", "delta")
        mode = self.opts.get("mode") or None
        if mode not in (None, "append", "complete"):
            raise ConfigError(f"onceflow-delta: mode={mode!r}; use 'append' or 'complete'")
        self.mode = mode
        try:
            self.row_group_rows = int(self.opts.get("row_group_rows", 1_000_000))
        except ValueError:
            raise ConfigError("onceflow-delta: row_group_rows must be a whole number") from None

    def app_id(self, lineage: str) -> str:
        return f"onceflow-{self.sink_id}-{lineage}"

    def _table(self) -> DeltaTable | None:
        try:
            return DeltaTable(self.table_url)
        except TableNotFoundError:
            return None

    def _fs(self):
        return url_to_fs(self.table_url)

    # ---- validation -----------------------------------------------------------------

    def _mode(self, overwrite: bool) -> str:
        """The effective mode: Spark's complete output mode means complete, else append."""
        return "complete" if overwrite else "append"

    def validate(self, schema: StructType, overwrite: bool) -> None:
        if self.mode is not None and self.mode != self._mode(overwrite):
            raise ConfigError(
                f"onceflow-delta: sink mode {self.mode!r} does not match the query's output mode "
                f"({'complete' if overwrite else 'append/update'}); use DeltaSink(mode="
                f"{self._mode(overwrite)!r}) or leave the mode out to follow the query"
            )
        fs, path = self._fs()
        table = self._table()
        if table is None:
            foreign = [
                n for n in (fs.ls(path, detail=False) if fs.exists(path) else [])
                if not _FILE.match(n.rstrip("/").rsplit("/", 1)[-1])
            ]
            if foreign:
                raise ConfigError(
                    f"onceflow-delta: {self.table_url} exists and is not a Delta table (no "
                    "_delta_log); give an empty or new directory, or an existing Delta table"
                )
            try:
                fs.makedirs(path, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"onceflow-delta: cannot create {self.table_url}: {e}") from None
            return
        want = to_arrow_schema(schema)
        have = pa.schema(table.schema().to_arrow())
        want_cols = {f.name: f.type for f in want}
        have_cols = {f.name: pa.field(f.name, f.type).type for f in have}
        if want_cols.keys() != have_cols.keys():
            raise ConfigError(
                f"onceflow-delta: the stream's columns {sorted(want_cols)} do not match table "
                f"{self.table_url} columns {sorted(have_cols)}; select matching columns or use a new table"
            )
        bad = [
            f"{n} ({want_cols[n]} vs table {have_cols[n]})"
            for n in want_cols
            if not _compatible(want_cols[n], have_cols[n])
        ]
        if bad:
            raise ConfigError(
                f"onceflow-delta: column types differ from table {self.table_url}: {', '.join(bad)}; "
                "cast them in the transform or use a new table"
            )

    # ---- tasks ----------------------------------------------------------------------

    def is_decided(self, lineage: str, batch_id: int) -> bool:
        table = self._table()
        if table is None:
            return False
        version = table.transaction_version(self.app_id(lineage))
        return version is not None and version >= batch_id

    def pre_commit(self, task: TaskInfo, schema: StructType, overwrite: bool, batches: Iterator):
        arrow_schema = to_arrow_schema(schema)
        name = _file_name(task)
        fs, path = self._fs()
        rows = 0
        full = f"{path}/{name}"
        fs.makedirs(path, exist_ok=True)
        with fs.open(full, "wb") as f:
            writer = pq.ParquetWriter(f, arrow_schema, compression="snappy")
            try:
                for batch in batches:
                    if batch.num_rows:
                        writer.write_batch(
                            batch.cast(arrow_schema) if batch.schema != arrow_schema else batch,
                            row_group_size=self.row_group_rows,
                        )
                        rows += batch.num_rows
            finally:
                writer.close()
        if rows == 0 and not overwrite:
            fs.rm(full)
            return None, 0
        size = fs.size(full)
        handle = {"path": name, "size": size, "rows": rows, "mtime": int(time.time() * 1000)}
        return handle, rows

    # ---- driver ---------------------------------------------------------------------

    def decision(self, lineage: str, batch_id: int) -> Decision | None:
        table = self._table()
        if table is None:
            return None
        version = table.transaction_version(self.app_id(lineage))
        if version is None or version < batch_id:
            return None
        meta = _commit_meta(table, lineage, batch_id)
        if meta is None:  # decided, but its commit entry is gone (log cleanup): files unknown
            return Decision(lineage, batch_id, "unknown", handles=None)
        files = meta.get("files", [])
        return Decision(lineage, batch_id, meta.get("fingerprint", "unknown"), [{"path": p} for p in files])

    def decide(self, decision: Decision, schema: StructType, overwrite: bool) -> None:
        """One Delta commit: add actions + app transaction = decision and commit at once."""
        adds = [
            AddAction(
                path=h["path"], size=h["size"], partition_values={}, modification_time=h["mtime"],
                data_change=True, stats=json.dumps({"numRecords": h["rows"]}),
            )
            for h in decision.handles
        ]
        props = CommitProperties(
            custom_metadata={
                "onceflow": json.dumps({
                    "lineage": decision.lineage, "batch": decision.batch_id,
                    "fingerprint": decision.fingerprint, "files": [h["path"] for h in decision.handles],
                })
            },
            app_transactions=[Transaction(self.app_id(decision.lineage), decision.batch_id)],
        )
        mode = "overwrite" if overwrite else "append"
        arrow_schema = to_arrow_schema(schema)
        table = self._table()
        try:
            if table is None:
                create_table_with_add_actions(
                    self.table_url, _delta_schema(arrow_schema), adds, mode="append",
                    commit_properties=props,
                )
            else:
                if not adds and mode == "append":
                    # Nothing to add: still record the app transaction and fingerprint.
                    pass
                table.create_write_transaction(adds, mode, arrow_schema, commit_properties=props)
        except Exception as e:  # delta-rs raises several types; say what failed
            raise SinkError(f"onceflow-delta: commit of batch {decision.batch_id} to {self.table_url} failed: {e}") from e

    def commit(self, decision: Decision) -> None:
        """Visible since :meth:`decide`; here only remove files of losing attempts.

        Never deletes a file the decision lists; when the decision's file list is unknown
        (its log entry was cleaned up) nothing is deleted at all.
        """
        maybe_crash("mid_commit", decision.batch_id, None, self.opts)
        if decision.handles is None:
            return
        keep = {h["path"] for h in decision.handles}
        self._remove_files(decision.lineage, lambda b, name: b == decision.batch_id and name not in keep)

    def abort(self, lineage: str, batch_id: int, handles: list[Any]) -> None:
        fs, path = self._fs()
        for h in handles:
            if h:
                fs.rm(f"{path}/{h['path']}") if fs.exists(f"{path}/{h['path']}") else None

    def recover(self, lineage: str, in_flight: Sequence[Any] = ()) -> dict[str, int]:
        """Delete this lineage's files that no decision references (except in-flight ones).

        Orphans are files of batches after the last decided one, and files of the last decided
        batch that its decision does not list (a crash interrupted :meth:`commit`'s cleanup).
        Files of earlier versions are never touched, so time travel keeps working.
        """
        table = self._table()
        if table is None:
            return {"orphans_removed": 0}
        version = table.transaction_version(self.app_id(lineage))
        last = -1 if version is None else version
        keep = {h["path"] for h in in_flight if h}
        if last >= 0:
            meta = _commit_meta(table, lineage, last)
            if meta is None:  # unknown file list: only clean batches after the decided one
                last_files = None
            else:
                last_files = set(meta.get("files", []))
        else:
            last_files = set()

        def orphan(b: int, name: str) -> bool:
            if name in keep:
                return False
            if b > last:
                return True
            return b == last and last_files is not None and name not in last_files

        return {"orphans_removed": self._remove_files(lineage, orphan)}

    def _remove_files(self, lineage: str, predicate) -> int:
        fs, path = self._fs()
        removed = 0
        for full in fs.ls(path, detail=False):
            name = full.rstrip("/").rsplit("/", 1)[-1]
            m = _FILE.match(name)
            if m and m["lineage"] == lineage and predicate(int(m["batch"]), name):
                fs.rm(full)
                removed += 1
        return removed


def _commit_meta(table: DeltaTable, lineage: str, batch_id: int) -> dict | None:
    """onceflow's commit info (fingerprint, files) of batch N of this lineage, newest first.

    Looks at recent versions first and only then walks the whole remaining log.
    """
    for limit in (64, None):
        for entry in table.history(limit=limit):
            meta = entry.get("onceflow")
            if isinstance(meta, str):
                meta = json.loads(meta)
            if meta and meta.get("lineage") == lineage and meta.get("batch") == batch_id:
                return meta
    return None


def _compatible(a: pa.DataType, b: pa.DataType) -> bool:
    if a == b:
        return True
    norm = {pa.large_string(): pa.string(), pa.large_binary(): pa.binary(), pa.string_view(): pa.string()}
    a, b = norm.get(a, a), norm.get(b, b)
    if pa.types.is_timestamp(a) and pa.types.is_timestamp(b):
        return True
    return a == b


def _delta_schema(arrow_schema: pa.Schema):
    from deltalake import Schema

    return Schema.from_arrow(arrow_schema)


@dataclass
class DeltaSink(Sink):
    """Exactly-once Delta Lake sink for a :class:`~onceflow.Job` (or ``writeStream``).

    ``path``: table URL; ``mode``: ``append`` or ``complete`` (default: follow the query's
    output mode; a mode that contradicts it is refused); ``sink_id`` distinguishes two Delta
    sinks of one job writing the same table.
    """

    path: str
    mode: str | None = None
    sink_id: str = "delta"

    format_name = "onceflow-delta"

    def options(self) -> dict[str, str]:
        opts = {"path": str(self.path), "sink_id": self.sink_id}
        if self.mode:
            opts["mode"] = self.mode
        return opts
