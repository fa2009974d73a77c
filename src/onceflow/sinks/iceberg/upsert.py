"""Upsert and delete (``write="upsert"``) for the Iceberg sink: one snapshot per batch.

Tasks stage their rows as Parquet files in the table's ``data/`` directory, named as an
append's task files (invisible: no snapshot lists them). The driver's decision reads the
batch's staged rows, keeps the last event per key (:func:`~onceflow.sinks.upserts.last_per_key`) and commits, on top
of exactly the metadata its fence and decided-batch check read, ONE snapshot that

* removes every data file holding a key of the batch, adding back a rewrite of its other rows
  (copy-on-write: no delete files, so any Iceberg reader sees deleted and replaced rows gone),
* adds one file of the winning rows that are not deletes,

and carries (lineage, batch, epoch, fingerprint, staged files, files it added) in its summary,
with the lineage's state property, as an append's decision does. A replay, a zombie or a lost
commit reply therefore finds the batch decided and applies nothing.

Within a batch the last event per key wins, deterministically: the largest ``order_by`` value
(null sorts first, so loses), ties (and every row without ``order_by``) broken by the batch's
own order, task partition id then row position in the task. A winning event whose delete
column is true (null: false) deletes the key; an absent key that is deleted stays absent.
Null keys are refused in the task (:func:`check_keys`): an Iceberg row with a null key could be
neither matched nor replaced.

A commit refused because another writer committed first is not planned again from scratch
when it need not be (:class:`UpsertPlan`): if every snapshot committed since the plan's base
only appended data files, none of which holds a key of the batch, and the schema and partition
spec are the same, the same removes and adds are committed on the new metadata (what Iceberg's
own conflict validation accepts); anything else is planned again. A plan that re-read and
rewrote the touched files after every refusal lost every race against a writer committing more
often than a plan takes, and starved.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from onceflow.errors import ConfigError
from onceflow.sinks.upserts import DELETE_COLUMN, last_per_key, parse_wire

#: snapshot summary entry of an upsert decision: the data files it added (JSON list of names)
OUTPUTS = "onceflow.outputs"
_IN_LIMIT = 200  # distinct keys up to which the file pruning filter lists them (pyiceberg's limit)
_WALK_LIMIT = 1000  # snapshots since a plan's base checked before planning again instead
_FMT = "onceflow-iceberg"


@dataclass(frozen=True)
class UpsertSpec:
    """``keys`` identify a row; ``order_by`` orders a key's events in a batch (largest wins);
    ``delete_column`` is a boolean column marking deletes (never written to the table)."""

    keys: tuple[str, ...]
    order_by: str | None = None
    delete_column: str | None = None

    @classmethod
    def from_options(cls, opts: Mapping[str, str]) -> UpsertSpec | None:
        """The spec of ``write=upsert`` options; None for appends. Bad options: ConfigError."""
        parsed = parse_wire(opts, _FMT)
        return None if parsed is None else cls(*parsed)

    def data_names(self, names: Sequence[str]) -> list[str]:
        """The stream's columns that are written (all but the delete column)."""
        return [n for n in names if n != self.delete_column]

    def check(self, stream: pa.Schema) -> None:
        """Keys and ``order_by`` are written columns of a flat type; the delete column, when the
        stream has it (a Job adds it after this check), is boolean. ConfigError otherwise."""
        names = self.data_names(stream.names)
        for k in self.keys:
            if k not in names:
                raise ConfigError(f"{_FMT}: key column {k!r} is not a column of the stream "
                                  f"({', '.join(names)})")
            if pa.types.is_nested(stream.field(k).type) or pa.types.is_floating(stream.field(k).type):
                raise ConfigError(f"{_FMT}: key column {k!r} has type {stream.field(k).type}; keys must "
                                  "be integers, strings, dates, timestamps, decimals or booleans")
        if self.order_by and self.order_by not in names:
            raise ConfigError(f"{_FMT}: order_by={self.order_by!r} is not a column of the stream "
                              f"({', '.join(names)})")
        if self.order_by and pa.types.is_nested(stream.field(self.order_by).type):
            raise ConfigError(f"{_FMT}: order_by={self.order_by!r} has a nested type; give an orderable column")
        if self.delete_column and self.delete_column in stream.names:
            if self.delete_column in self.keys or self.delete_column == self.order_by:
                raise ConfigError(f"{_FMT}: the delete column {self.delete_column!r} cannot be a key or order_by")
            if not pa.types.is_boolean(stream.field(self.delete_column).type):
                raise ConfigError(f"{_FMT}: the delete column {self.delete_column!r} must be boolean, "
                                  f"not {stream.field(self.delete_column).type}")
        elif self.delete_column and self.delete_column != DELETE_COLUMN:
            raise ConfigError(f"{_FMT}: delete_column={self.delete_column!r} is not a column of the stream")


def check_keys(batch: pa.RecordBatch, spec: UpsertSpec) -> None:
    """Refuse a task's rows with a null key (ConfigError naming the column)."""
    for k in spec.keys:
        column = batch.column(batch.schema.get_field_index(k))
        if column.null_count:
            raise ConfigError(f"{_FMT}: {column.null_count} row(s) with a null key column {k!r}; upsert "
                              "keys must not be null (filter or fill them in the transform)")


def read_staged(fs: Any, data_dir: str, names: Sequence[str]) -> pa.Table:
    """The batch's staged rows in batch order: task files sorted by (partition, attempt), each
    in its rows' order (one file per task; names from :func:`~onceflow.sinks.files.file_name`)."""
    def order(name: str) -> tuple[int, int, str]:
        part = name.split("-p", 1)[1] if "-p" in name else "0"
        p, _, rest = part.partition("-a")
        return int(p) if p.isdigit() else 0, int(rest.split("-", 1)[0] or 0), name

    tables = []
    for name in sorted(names, key=order):
        with fs.open(f"{data_dir}/{name}", "rb") as f:
            tables.append(pq.read_table(f))
    if not tables:
        return pa.table({})
    return pa.concat_tables(tables, promote_options="permissive")


@dataclass
class BatchChange:
    """What a batch does to the table: its winning rows (``upserts``, delete column dropped) and
    the keys it touches (``keys``: every winner's, deleted or not)."""

    upserts: pa.Table
    keys: pa.Table
    deleted: int

    @classmethod
    def of(cls, staged: pa.Table, spec: UpsertSpec) -> BatchChange:
        if staged.num_rows == 0:  # no task wrote rows: the batch changes nothing
            return cls(pa.table({}), pa.table({}), 0)
        winners = last_per_key(staged, spec.keys, spec.order_by)
        keys, deleted = winners.select(list(spec.keys)), 0
        if spec.delete_column and spec.delete_column in winners.column_names:
            flag = pc.fill_null(winners.column(spec.delete_column), False)
            deleted = pc.sum(flag).as_py() or 0
            winners = winners.filter(pc.invert(flag)).drop_columns([spec.delete_column])
        return cls(winners, keys, deleted)

    def prune_filter(self) -> Any:
        """A pyiceberg row filter every data file holding one of the batch's keys matches (a
        superset: per key column its range, and its values when few)."""
        from pyiceberg.expressions import AlwaysTrue, And, GreaterThanOrEqual, In, LessThanOrEqual

        expr: Any = AlwaysTrue()
        for name in self.keys.column_names:
            column = self.keys.column(name)
            t = column.type
            if not (pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)):
                continue
            bounds = pc.min_max(column)
            lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
            if lo is None:
                continue
            expr = And(expr, And(GreaterThanOrEqual(name, lo), LessThanOrEqual(name, hi)))
            distinct = pc.unique(column)
            if len(distinct) <= _IN_LIMIT:
                expr = And(expr, In(name, set(distinct.to_pylist())))
        return expr

    def matching(self, rows: pa.Table) -> pa.Array:
        """Boolean mask: which of ``rows`` (a data file's) have a key of this batch."""
        names = self.keys.column_names
        keys = self.keys.cast(pa.schema([rows.schema.field(n).with_nullable(True) for n in names]))
        if len(names) == 1:
            return pc.is_in(rows.column(names[0]), value_set=keys.column(0))
        index = pa.array(np.arange(rows.num_rows, dtype=np.int64))
        probe = rows.select(names).append_column("__onceflow_i", index)
        hit = probe.join(keys, names, join_type="left semi", use_threads=False).column("__onceflow_i")
        return pc.is_in(index, value_set=hit)


def rewrites(table: Any, change: BatchChange) -> list[tuple[Any, pa.Table | None]]:
    """(data file, its rows that stay) for every live data file of ``table`` holding a key of
    the batch: None when none stays (the file is only removed). Reads through pyiceberg, so
    the file's position deletes apply."""
    if table.current_snapshot() is None or change.keys.num_rows == 0:
        return []
    from pyiceberg.expressions import AlwaysTrue
    from pyiceberg.io.pyarrow import ArrowScan

    out: list[tuple[Any, pa.Table | None]] = []
    for task in table.scan(row_filter=change.prune_filter()).plan_files():
        rows = ArrowScan(table.metadata, table.io, table.schema(), AlwaysTrue()).to_table([task])
        hit = change.matching(rows)
        if not pc.any(hit).as_py():
            continue
        kept = rows.filter(pc.invert(pc.fill_null(hit, False)))
        out.append((task.file, kept if kept.num_rows else None))
    return out


def write_file(fs: Any, path: str, rows: pa.Table, schema: pa.Schema, compression: str = "zstd") -> None:
    """``rows`` (columns by name) as one Parquet file with the table's field ids."""
    rows = rows.select(schema.names).cast(schema)
    with fs.open(path, "wb") as f:
        pq.write_table(rows, f, compression=compression)


@dataclass
class UpsertPlan:
    """One planned upsert commit, valid on top of snapshot ``base`` (None: the empty table):
    the data files it removes and the files it wrote to add (``added`` names, ``files`` their
    pyiceberg data files)."""

    change: BatchChange
    base: int | None
    schema_id: int
    spec_id: int
    removed: list[Any]
    added: list[str]
    files: list[Any]

    def holds_on(self, table: Any) -> bool:
        """Whether the plan may be committed unchanged on ``table``'s current metadata: the same
        schema and partition spec, and every snapshot on ``main`` since ``base`` an append
        whose data files cannot hold a key of the batch (key-column bounds, then the rows
        themselves when the bounds cannot tell). Anything else (an overwrite, a delete, delete
        files, a base no longer an ancestor): False, the batch is planned again."""
        from pyiceberg.table.snapshots import Operation

        meta = table.metadata
        if (meta.current_schema_id, meta.default_spec_id) != (self.schema_id, self.spec_id):
            return False
        snapshot = table.current_snapshot()
        for _ in range(_WALK_LIMIT):
            if (snapshot.snapshot_id if snapshot else None) == self.base:
                return True
            if (snapshot is None or snapshot.summary is None or snapshot.summary.operation != Operation.APPEND
                    or self._touched_by(table, snapshot)):
                return False
            parent = snapshot.parent_snapshot_id
            snapshot = None if parent is None else meta.snapshot_by_id(parent)
            if parent is not None and snapshot is None:
                return False  # history expired: cannot tell
        return False

    def _touched_by(self, table: Any, snapshot: Any) -> bool:
        """Whether ``snapshot`` added delete files or a data file holding a key of the batch."""
        # pyiceberg's metrics evaluator is private; the pin (>=0.12,<0.13) keeps it in place
        from pyiceberg.expressions import AlwaysTrue
        from pyiceberg.expressions.visitors import _InclusiveMetricsEvaluator
        from pyiceberg.io.pyarrow import ArrowScan
        from pyiceberg.manifest import ManifestContent, ManifestEntryStatus
        from pyiceberg.table import FileScanTask

        if self.change.keys.num_rows == 0:
            return False
        bounds = _InclusiveMetricsEvaluator(table.schema(), self.change.prune_filter())
        for manifest in snapshot.manifests(table.io):
            if manifest.added_snapshot_id != snapshot.snapshot_id:
                continue
            if manifest.content != ManifestContent.DATA:
                return True
            for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
                if entry.status != ManifestEntryStatus.ADDED or not bounds.eval(entry.data_file):
                    continue
                rows = ArrowScan(table.metadata, table.io, table.schema(), AlwaysTrue()).to_table(
                    [FileScanTask(entry.data_file)])
                if pc.any(self.change.matching(rows)).as_py():
                    return True
        return False
