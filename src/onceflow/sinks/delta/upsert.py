"""Upsert and delete (``write="upsert"``) for the Delta sink: one MERGE per batch.

Tasks stage their rows as Parquet files in the table directory, as appends do (invisible: not
in the log). The decision is one delta-rs MERGE of the batch's staged rows, committed on top of
exactly the snapshot the fencing checks read (``max_commit_retries=0``) and carrying the
lineage's app transaction at version = batch id, as an append's commit does. So a replay, a
zombie or a lost commit reply finds the batch decided and merges nothing: applying a batch
twice changes nothing. No session-global configuration is involved, so several jobs may
upsert into one table (a commit that loses a race is read again and retried on top).

Within a batch the last event per key wins, deterministically: the largest ``order_by``
value, ties (and every row without ``order_by``) broken by the batch's own order, task
partition id then row position in the task (a replay of a replayable source reads the same
rows into the same partitions in the same order). A winning event whose delete column is true
deletes the key's row (delta-rs rewrites the files that hold it: any Delta reader sees it
gone); a key that is absent and deleted stays absent. Keys are matched null-safely.
Staged files are deleted once their batch is decided (:func:`staged_rule`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable

from onceflow.errors import ConfigError
from onceflow.sinks.upserts import parse_wire


@dataclass(frozen=True)
class UpsertSpec:
    """``keys`` identify a row; ``order_by`` orders a key's events in a batch (largest wins);
    ``delete_column`` is a boolean column that marks deletes (dropped before writing)."""

    keys: tuple[str, ...]
    order_by: str | None = None
    delete_column: str | None = None

    @classmethod
    def from_options(cls, opts: Mapping[str, str]) -> UpsertSpec | None:
        """The spec of ``write=upsert`` options; None for appends. Bad options: ConfigError."""
        parsed = parse_wire(opts, "onceflow-delta")
        return None if parsed is None else cls(*parsed)

    def check(self, stream: pa.Schema, where: str) -> None:
        """Every named column exists; the delete column is boolean; no key is the delete column."""
        names = set(stream.names)
        for what, cols in (("keys", self.keys), ("order_by", (self.order_by,) if self.order_by else ()),
                           ("delete_column", (self.delete_column,) if self.delete_column else ())):
            missing = [c for c in cols if c not in names]
            if missing:
                raise ConfigError(f"{where}: {what} names {', '.join(missing)}, not a column of the stream "
                                  f"({', '.join(stream.names)})")
        if self.delete_column:
            if self.delete_column in self.keys:
                raise ConfigError(f"{where}: the delete column {self.delete_column} cannot be a key")
            if not pa.types.is_boolean(stream.field(self.delete_column).type):
                raise ConfigError(f"{where}: delete column {self.delete_column} must be boolean, not "
                                  f"{stream.field(self.delete_column).type}")

    def table_columns(self, names: Sequence[str]) -> list[str]:
        """The stream's columns that the table holds (all but the delete column)."""
        return [n for n in names if n != self.delete_column]


def read_staged(fs: Any, root: str, handles: Sequence[Mapping[str, Any]]) -> pa.Table | None:
    """The batch's staged rows in the batch's order (task partition, then row); None when no
    task staged a row."""
    parts = []
    for h in sorted(handles, key=lambda h: (h.get("task", 0), h["path"])):
        with fs.open(f"{root}/{h['path']}", "rb") as f:
            rows = pq.read_table(f)
        if rows.num_rows:
            parts.append(rows)
    if not parts:
        return None
    return pa.concat_tables(parts, promote_options="default").combine_chunks()


def merge(table: DeltaTable, rows: pa.Table, spec: UpsertSpec, props: CommitProperties,
          merge_schema: bool) -> dict[str, Any]:
    """One MERGE of ``rows`` (one per key) into ``table`` at its loaded version, committed with
    ``props`` (CommitFailedError when anything landed since). Returns delta-rs's metrics."""
    null_keys = any(rows.column(k).null_count for k in spec.keys)
    eq = "IS NOT DISTINCT FROM" if null_keys else "="  # '=' lets delta-rs prune files
    predicate = " AND ".join(f"t.{_q(k)} {eq} s.{_q(k)}" for k in spec.keys)
    columns = {_q(c): f"s.{_q(c)}" for c in spec.table_columns(rows.column_names)}
    keep = None
    if spec.delete_column:
        rows = rows.set_column(rows.column_names.index(spec.delete_column), spec.delete_column,
                               pc.fill_null(rows.column(spec.delete_column), False))
        keep = f"NOT s.{_q(spec.delete_column)}"
    merger = table.merge(rows, predicate, source_alias="s", target_alias="t", merge_schema=merge_schema,
                         commit_properties=props)
    if spec.delete_column:
        merger = merger.when_matched_delete(f"s.{_q(spec.delete_column)}")
    return merger.when_matched_update(columns, keep).when_not_matched_insert(columns, keep).execute()


def _q(name: str) -> str:
    """A column name quoted for delta-rs's SQL (DataFusion)."""
    return '"' + name.replace('"', '""') + '"'


def staged_rule(last: int, mine: int | None, keep: frozenset[str] | set[str] = frozenset()
                ) -> Callable[[int, int, str], bool]:
    """Whether a staged unit of (batch, epoch, name) may be deleted: of a decided batch (up to
    ``last``; merged already, whatever its epoch) or of an older epoch than ``mine`` (an older
    epoch can never decide), never one of a newer epoch, nor one in flight (``keep``)."""

    def garbage(b: int, e: int, name: str) -> bool:
        if name in keep or (mine is not None and e > mine):
            return False
        return b <= last or (mine is not None and e < mine)

    return garbage
