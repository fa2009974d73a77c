"""COPY encoder of the PostgreSQL sink: Arrow record batches into a table or staging table.

Guarantees: :func:`_copy` sends every row of the batches, in order, through ONE ``COPY ... FROM
STDIN`` inside the caller's transaction (so a task's rows are committed or prepared together
with the rest of its transaction, or not at all) and returns the row count. Binary COPY, built
with numpy without a per-row Python loop, is used when every column's Arrow type has exactly the
binary representation of its table column; otherwise CSV written by pyarrow's C++ writer, which
PostgreSQL converts (decimals, widening). Values round-trip unchanged, NULLs included. In upsert
staging mode each row is tagged with (lineage, batch, partition, position in the partition).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack

import numpy as np
import psycopg
import pyarrow as pa
import pyarrow.csv as pacsv
from psycopg import sql

_CSV = pacsv.WriteOptions(include_header=False)
# Upsert staging table: (lineage, batch, partition, position of the row in its partition).
STAGE_COLUMNS = {"_onceflow_lineage": "text", "_onceflow_batch": "bigint",
                 "_onceflow_partition": "integer", "_onceflow_seq": "bigint"}


def _csv_ready(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Binary columns as PostgreSQL hex bytea text; everything else pyarrow's CSV writes as is."""
    cols = batch.columns
    if not any(pa.types.is_binary(c.type) or pa.types.is_large_binary(c.type) for c in cols):
        return batch
    out = [
        pa.array([None if v is None else "\\x" + v.hex() for v in c.to_pylist()], pa.string())
        if pa.types.is_binary(c.type) or pa.types.is_large_binary(c.type) else c
        for c in cols
    ]
    return pa.RecordBatch.from_arrays(out, names=batch.schema.names)


# Binary COPY: Arrow type -> (numpy big-endian dtype or None for variable width, PostgreSQL
# types with that exact binary representation). Anything else goes through CSV.
_PGCOPY_SIGNATURE = b"PGCOPY\n\xff\r\n\x00" + bytes(8)
_PGCOPY_TRAILER = b"\xff\xff"
_PG_EPOCH_US = 946_684_800_000_000
_PG_EPOCH_DAYS = 10_957
_TEXT_TYPES = {"text", "character varying", "character"}


def _binary_pg_types(t: pa.DataType) -> set[str]:
    if pa.types.is_int64(t):
        return {"bigint"}
    if pa.types.is_int32(t):
        return {"integer"}
    if pa.types.is_int16(t) or pa.types.is_int8(t):
        return {"smallint"}
    if pa.types.is_float64(t):
        return {"double precision"}
    if pa.types.is_float32(t):
        return {"real"}
    if pa.types.is_boolean(t):
        return {"boolean"}
    if pa.types.is_timestamp(t):
        return {"timestamp with time zone", "timestamp without time zone"}
    if pa.types.is_date32(t):
        return {"date"}
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return _TEXT_TYPES
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return {"bytea"}
    return set()


def _fixed_values(col: pa.Array) -> np.ndarray | None:
    """Big-endian payloads of a fixed-width column (nulls filled with 0), None if variable width."""
    t = col.type
    if pa.types.is_timestamp(t):
        us = col.cast(pa.timestamp("us", tz=t.tz)).cast(pa.int64()).fill_null(0).to_numpy()
        return (us - _PG_EPOCH_US).astype(">i8")
    if pa.types.is_date32(t):
        return (col.cast(pa.int32()).fill_null(0).to_numpy() - _PG_EPOCH_DAYS).astype(">i4")
    if pa.types.is_boolean(t):
        return col.fill_null(False).to_numpy(zero_copy_only=False).astype(np.uint8)
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        dtype = {"int8": ">i2", "int16": ">i2", "int32": ">i4", "int64": ">i8", "float": ">f4", "double": ">f8"}[str(t)]
        return col.fill_null(0).to_numpy().astype(dtype)
    return None


def _scatter(out: np.ndarray, starts: np.ndarray, chunks: np.ndarray) -> None:
    out[starts[:, None] + np.arange(chunks.shape[1])] = chunks


def encode_binary(batch: pa.RecordBatch) -> memoryview:
    """The batch's rows in PostgreSQL's binary COPY tuple format, built with numpy (no per-row Python)."""
    n = batch.num_rows
    row_size = np.full(n, 2, dtype=np.int64)
    cols = []
    for col in batch.columns:
        valid = col.is_valid().to_numpy(zero_copy_only=False)
        fixed = _fixed_values(col)
        if fixed is not None:
            size = np.where(valid, fixed.dtype.itemsize, 0)
            cols.append((valid, size, fixed, None))
        else:
            large = pa.types.is_large_string(col.type) or pa.types.is_large_binary(col.type)
            bufs = col.buffers()
            offsets = np.frombuffer(bufs[1], dtype=np.int64 if large else np.int32)[col.offset: col.offset + n + 1]
            offsets = offsets.astype(np.int64)
            data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
            size = np.where(valid, np.diff(offsets), 0)
            cols.append((valid, size, data, offsets))
        row_size += 4 + size
    row_start = np.cumsum(row_size) - row_size
    out = np.empty(int(row_size.sum()), dtype=np.uint8)
    _scatter(out, row_start, np.full(n, len(cols), dtype=">i2").view(np.uint8).reshape(n, 2))
    pos = row_start + 2
    for valid, size, values, offsets in cols:
        _scatter(out, pos, np.where(valid, size, -1).astype(">i4").view(np.uint8).reshape(n, 4))
        payload = pos + 4
        if offsets is None:
            rows = slice(None) if valid.all() else valid.nonzero()[0]
            _scatter(out, payload[rows], values[rows].view(np.uint8).reshape(-1, values.dtype.itemsize))
        elif (total := int(size.sum())) > 0:
            rel = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(size) - size, size)
            out[np.repeat(payload, size) + rel] = values[np.repeat(offsets[:-1], size) + rel]
        pos = payload + size
    return memoryview(out)


def _copy(cur: psycopg.Cursor, target: sql.Composable, columns: list[str], batches: Iterator,
          table_types: dict[str, str], stage: tuple[str, int, int] | None = None) -> int:
    """COPY Arrow record batches into ``target``; returns the row count.

    ``stage`` = (lineage, batch, partition): prepend the staging columns of :data:`STAGE_COLUMNS`
    (those three plus the row's position in the partition).
    Binary COPY (numpy-encoded) when every column's Arrow type has the table column's binary
    representation; otherwise CSV written by pyarrow's C++ writer (e.g. decimals, widening).
    """
    names = ([*STAGE_COLUMNS] if stage else []) + columns
    rows, binary = 0, None
    with ExitStack() as stack:
        for batch in batches:
            if not batch.num_rows:
                continue
            if stage:
                n = batch.num_rows
                batch = pa.RecordBatch.from_arrays(
                    [pa.array([stage[0]] * n, pa.string()), pa.array(np.full(n, stage[1], np.int64)),
                     pa.array(np.full(n, stage[2], np.int32)), pa.array(np.arange(rows, rows + n, dtype=np.int64)),
                     *batch.columns],
                    names=names,
                )
            if binary is None:
                binary = all(
                    re.sub(r"\(.*\)", "", table_types.get(name, "")) in _binary_pg_types(f.type)
                    for name, f in zip(names, batch.schema, strict=True)
                )
                stmt = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT {})").format(
                    target, sql.SQL(", ").join(map(sql.Identifier, names)), sql.SQL("binary" if binary else "csv"))
                cp = stack.enter_context(cur.copy(stmt))
                if binary:
                    cp.write(_PGCOPY_SIGNATURE)
            if binary:
                cp.write(encode_binary(batch))
            else:
                buf = pa.BufferOutputStream()
                pacsv.write_csv(_csv_ready(batch), buf, _CSV)
                cp.write(memoryview(buf.getvalue()))
            rows += batch.num_rows
        if binary:
            cp.write(_PGCOPY_TRAILER)
    return rows
