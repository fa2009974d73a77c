"""The Arrow path's task writes: one Parquet file per task, or for a partitioned table one
directory per task with a file per partition value in Hive-style subdirectories
(:mod:`.partitions`). Either is one unit (:mod:`.files`): invisible until the decision commit
adds it, deleted whole by clean-up otherwise. A crash mid-write leaves a partial unit that
recovery or the batch's commit removes, as before."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from onceflow.sinks.delta.files import dictionary_columns
from onceflow.sinks.delta.partitions import directory, split

#: rows a partition's buffer collects before it is written as a row group (small batches
#: split 32 ways would otherwise make row groups of a few hundred rows)
BUFFER_ROWS = 131_072


def _conform(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    return batch if batch.schema == schema else batch.cast(schema)


def write_file(fs, full: str, schema: pa.Schema, batches: Iterator, row_group_rows: int,
               keep_empty: bool) -> tuple[int, int]:
    """All rows into one Parquet file at ``full``; (rows, bytes) written. With no rows the file
    is removed unless ``keep_empty`` (complete mode keeps an empty file)."""
    rows = size = 0
    with fs.open(full, "wb") as f:
        writer = None
        try:
            for batch in batches:
                if batch.num_rows:
                    batch = _conform(batch, schema)
                    if writer is None:
                        writer = pq.ParquetWriter(f, schema, compression="snappy",
                                                  use_dictionary=dictionary_columns(batch))
                    writer.write_batch(batch, row_group_size=row_group_rows)
                    rows += batch.num_rows
        finally:
            if writer is None:  # no rows: a valid, empty file
                writer = pq.ParquetWriter(f, schema, compression="snappy")
            writer.close()
        size = f.tell()  # the file's size, without asking the store again
    if rows == 0 and not keep_empty:
        fs.rm(full)
    return rows, size


class _Part:
    """One partition value's open file and its buffered rows."""

    def __init__(self, fs, full: str, rel: str, values: dict[str, str | None]):
        self.full, self.rel, self.values = full, rel, values
        self.f = fs.open(full, "wb")
        self.writer: pq.ParquetWriter | None = None
        self.buffer: list[pa.Table] = []
        self.buffered = self.rows = 0

    def add(self, rows: pa.Table, row_group_rows: int) -> None:
        self.buffer.append(rows)
        self.buffered += rows.num_rows
        if self.buffered >= min(BUFFER_ROWS, row_group_rows):
            self.flush(row_group_rows)

    def flush(self, row_group_rows: int) -> None:
        if not self.buffered:
            return
        table = pa.concat_tables(self.buffer).combine_chunks()
        if self.writer is None:
            head = table.to_batches()[0] if table.num_rows else table
            self.writer = pq.ParquetWriter(self.f, table.schema, compression="snappy",
                                           use_dictionary=dictionary_columns(head))
        self.writer.write_table(table, row_group_size=row_group_rows)
        self.rows += table.num_rows
        self.buffer, self.buffered = [], 0

    def close(self) -> None:
        try:
            if self.writer is not None:
                self.writer.close()
        finally:
            self.f.close()


def write_partitioned(fs, root: str, unit: str, schema: pa.Schema, partition_by: Sequence[str],
                      batches: Iterator, row_group_rows: int, keep_empty: bool) -> tuple[list[dict[str, Any]], int]:
    """All rows into ``root/unit/<col>=<value>/part-<n>.parquet``, one file per partition
    value, without the partition columns; (files as add entries, rows written). With no rows
    and ``keep_empty`` one empty file of the null partition is kept (complete mode)."""
    parts: dict[tuple, _Part] = {}
    data_schema = pa.schema([f for f in schema if f.name not in partition_by])
    try:
        for batch in batches:
            if not batch.num_rows:
                continue
            for values, rows in split(_conform(batch, schema), partition_by):
                key = tuple(values[c] for c in partition_by)
                part = parts.get(key)
                if part is None:
                    rel = f"{unit}/{directory(partition_by, values)}/part-{len(parts):05d}.parquet"
                    fs.makedirs(f"{root}/{rel.rsplit('/', 1)[0]}", exist_ok=True)
                    part = parts[key] = _Part(fs, f"{root}/{rel}", rel, values)
                part.add(rows, row_group_rows)
        for part in parts.values():
            part.flush(row_group_rows)
    finally:
        for part in parts.values():
            part.close()
    now = int(time.time() * 1000)
    files = [{"path": p.rel, "size": fs.size(p.full), "rows": p.rows, "mtime": now,
              "partition": p.values} for p in parts.values()]
    if not parts and keep_empty:
        values: dict[str, str | None] = dict.fromkeys(partition_by)
        rel = f"{unit}/{directory(partition_by, values)}/part-00000.parquet"
        fs.makedirs(f"{root}/{rel.rsplit('/', 1)[0]}", exist_ok=True)
        with fs.open(f"{root}/{rel}", "wb") as f:
            pq.ParquetWriter(f, data_schema, compression="snappy").close()
        files = [{"path": rel, "size": fs.size(f"{root}/{rel}"), "rows": 0, "mtime": now,
                  "partition": values}]
    return files, sum(p.rows for p in parts.values())
