"""Exactly-once PostgreSQL sink on psycopg 3 (DESIGN.md sections 3 and 4).

Modes and their guarantees:

* ``two_phase`` (default; needs ``max_prepared_transactions`` > 0): each task COPYs its
  partition inside a transaction and ``PREPARE TRANSACTION``\\ s it under a global id
  ``onceflow:<sink>:<lineage>:<batch>:<partition>:<attempt>:<run>``. The driver records the
  decision (batch, fingerprint, gids) in the onceflow commit log, then ``COMMIT PREPARED``\\ s
  every gid. **Exactly-once, and a batch becomes visible as a whole** (modulo the instants
  between the individual COMMIT PREPARED statements of one batch).
* ``idempotent`` (for servers without prepared transactions): each task writes its rows and a
  (sink, lineage, batch, partition) marker in one local transaction; a replayed task that
  finds its marker writes nothing. **Exactly-once effect, weaker visibility** (append): a batch
  becomes visible partition by partition, and a failed batch can stay partly visible until it
  is replayed (always the next thing the same lineage does).

Write kinds: ``append`` (tasks COPY into the table inside their prepared/local transaction)
and ``upsert`` on declared key columns. In upsert, tasks never touch the table: they COPY their
rows, tagged (lineage, batch, partition, position in the partition), into an onceflow staging
table ``<log_schema>.onceflow_stage_<hash>`` inside that transaction. When the batch is decided
(and, in two_phase, all its prepared transactions are committed) the driver merges its staged
rows in ONE statement: ``DELETE`` them from staging and ``INSERT ... ON CONFLICT (keys) DO
UPDATE`` into the table, keeping per key the **last row in (partition, position) order** —
deterministic, whatever the partitions' timing. The merge is idempotent (a second one finds
nothing staged) and recovery repeats it for decided batches that still have staged rows. So in
both modes **an upsert batch becomes visible atomically**, and no task waits on another task's
row locks.

Prepared-transaction slots (:data:`SLOT_RULE`): every write task of a two_phase batch holds one
prepared transaction from its PREPARE until the batch commits, so ``max_prepared_transactions``
must be at least the write partitions of all two_phase onceflow queries running against the
server, plus the prepared transactions anything else holds there, plus headroom for speculative
task attempts; a task that finds no free slot fails with an error naming the setting.

Constraints in upsert: the staging table repeats the table's NOT NULL constraints and its CHECK
constraints over the stream's columns, so a row violating them fails its task before the batch
is decided. Foreign keys, other unique indexes and CHECKs involving other columns are only
enforced by the merge; a merge that fails raises a one-line SinkError (the batch stays staged
until the row or the constraint is fixed).

The password (in the DSN or the ``password`` option) never appears in errors, logs or
``repr``; pass it as the ``password`` option (which Spark redacts) when using plain
``writeStream``.

Safety invariants: a decision only lists gids that were still prepared when it was recorded,
and an undecided gid is only rolled back under the same per-lineage lock after re-reading the
decisions (so a decided gid is never rolled back). The fence is a session advisory lock per
(sink, lineage) held by :meth:`PostgresDataSource.open`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import numpy as np
import psycopg
import pyarrow as pa
import pyarrow.csv as pacsv
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.pq import TransactionStatus
from pyspark.sql import types as T
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from onceflow.errors import ConfigError, FencedError, SinkError
from onceflow.faults import maybe_crash
from onceflow.sinks.base import Decision, Sink, TaskInfo, TwoPhaseCommitSink

log = logging.getLogger(__name__)

FORMAT = "onceflow-postgres"
GID = re.compile(
    r"^onceflow:(?P<sink>[A-Za-z0-9_.-]+):(?P<lineage>[^:]+):(?P<batch>\d+):(?P<partition>\d+)"
    r":(?P<attempt>\d+):(?P<run>[0-9a-z-]+)$"
)
_SINK_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_CSV = pacsv.WriteOptions(include_header=False)
_R = TypeVar("_R")
#: idle connections kept for reuse, one per (server, credentials, thread) in this process
_IDLE: dict[tuple[str, str | None, int], psycopg.Connection] = {}

# ---- DSN handling: the password never leaves this module in clear ---------------------------


def split_dsn(dsn: str) -> tuple[str, str | None]:
    """(DSN without password as key=value conninfo, password or None). Accepts URL or key=value."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as e:
        if re.search(r"password|://[^/@]*:[^/@]*@", dsn, re.IGNORECASE):
            # libpq's message quotes fragments of the string, which may be pieces of the password
            raise ConfigError(
                f"{FORMAT}: cannot parse the DSN (details withheld: it contains a password); quote "
                "values with spaces or quotes, e.g. password='a b\\'c', or give the password as the "
                "'password' option"
            ) from None
        raise ConfigError(f"{FORMAT}: cannot parse the DSN ({str(e).strip()}); use a libpq URL or key=value string") from None
    password = params.pop("password", None)
    return make_conninfo(**{k: str(v) for k, v in params.items()}), password


def where(dsn: str) -> str:
    """``host:port/dbname`` for messages (never the password)."""
    params = conninfo_to_dict(split_dsn(dsn)[0])
    return f"{params.get('host', 'localhost')}:{params.get('port', 5432)}/{params.get('dbname', params.get('user', ''))}"


def mask_dsn(dsn: str) -> str:
    """The DSN with its password replaced by ``***``."""
    safe, password = split_dsn(dsn)
    return make_conninfo(safe, password="***") if password else safe


def _scrub(text: str, *secrets: str | None) -> str:
    for s in secrets:
        if s:
            text = text.replace(s, "***")
    return re.sub(r"(password\s*=\s*|://[^:/@\s]+:)[^@\s]+(@?)", r"\1***\2", text)


def _key(*parts: str) -> int:
    """A signed 64-bit advisory-lock key."""
    return int.from_bytes(hashlib.sha256(":".join(parts).encode()).digest()[:8], "big", signed=True)


# ---- types ---------------------------------------------------------------------------------

_PG_TYPES: dict[type, str] = {
    T.LongType: "bigint", T.IntegerType: "integer", T.ShortType: "smallint", T.ByteType: "smallint",
    T.DoubleType: "double precision", T.FloatType: "real", T.StringType: "text",
    T.BinaryType: "bytea", T.BooleanType: "boolean", T.TimestampType: "timestamp with time zone",
    T.TimestampNTZType: "timestamp without time zone", T.DateType: "date",
}
# table types a stream type may also be written into (widening / equivalent text types)
_ALSO: dict[str, set[str]] = {
    "integer": {"bigint", "numeric"}, "smallint": {"integer", "bigint", "numeric"},
    "bigint": {"numeric"}, "real": {"double precision"},
    "text": {"character varying", "character", "jsonb", "json"},
    "timestamp with time zone": {"timestamp without time zone"},
}


def pg_type(dt: T.DataType) -> str:
    """PostgreSQL type for a Spark type; raises ConfigError for unsupported ones."""
    if isinstance(dt, T.DecimalType):
        return f"numeric({dt.precision},{dt.scale})"
    for spark_type, name in _PG_TYPES.items():
        if isinstance(dt, spark_type):
            return name
    raise ConfigError(f"{FORMAT}: Spark type {dt.simpleString()} is not supported; cast it (e.g. to_json for nested types)")


_INT_DIGITS = {"smallint": 5, "integer": 10, "bigint": 19}


def _numeric_fits(want: str, have: str) -> bool:
    """A Spark decimal or integer into ``numeric(P,S)``: no fewer integer digits, no smaller scale."""
    m = re.fullmatch(r"numeric\((\d+),(\d+)\)", have.replace(" ", ""))
    if m is None:
        return True  # unconstrained numeric holds everything
    big, scale = int(m[1]), int(m[2])
    w = re.fullmatch(r"numeric\((\d+),(\d+)\)", want.replace(" ", ""))
    p, s = (int(w[1]), int(w[2])) if w else (_INT_DIGITS[want], 0)
    return scale >= s and big - scale >= p - s


def _type_ok(want: str, have: str) -> bool:
    """Can values of PostgreSQL type ``want`` (from the stream) be stored in column type ``have``
    without loss? Text into ``varchar(n)`` is allowed (a too-long value fails its task clearly)."""
    base = re.sub(r"\(.*\)", "", have).strip()
    want_base = re.sub(r"\(.*\)", "", want).strip()
    if base == "numeric" and (want_base == "numeric" or want_base in _INT_DIGITS):
        return _numeric_fits(want, have)
    return want == have or base == want_base or base in _ALSO.get(want_base, set())


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
# Upsert staging table: (lineage, batch, partition, position of the row in its partition).
STAGE_COLUMNS = {"_onceflow_lineage": "text", "_onceflow_batch": "bigint",
                 "_onceflow_partition": "integer", "_onceflow_seq": "bigint"}
#: The one sizing rule for ``max_prepared_transactions`` (PREPARE error, doctor, docs).
SLOT_RULE = (
    "every write task of a two_phase batch holds one prepared transaction from its PREPARE until the "
    "batch commits, so max_prepared_transactions must be at least the write partitions of all two_phase "
    "onceflow queries running against the server, plus the prepared transactions anything else holds "
    "there, plus headroom for speculative task attempts"
)


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


# ---- upsert staging tables -----------------------------------------------------------------


def _stage_meta(conn: psycopg.Connection, name: str) -> Any:
    """The parsed comment of staging table ``name`` (SQL text), or None."""
    comment = conn.execute("SELECT obj_description(to_regclass(%s), 'pg_class')", [name]).fetchone()[0]
    try:
        return json.loads(comment or "")
    except ValueError:
        return None


def stage_tables(conn: psycopg.Connection, log_schema: str) -> list[tuple[sql.Identifier, dict[str, Any]]]:
    """(staging table, metadata) of every onceflow upsert staging table in ``log_schema``; the
    metadata (sink_id, table, keys, constraints) is the table's comment, so recovery and
    ``onceflow doctor --resolve`` can merge without the job's options."""
    found = conn.execute(
        "SELECT c.relname, obj_description(c.oid, 'pg_class') FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relkind = 'r' AND starts_with(c.relname, 'onceflow_stage_')",
        [log_schema],
    ).fetchall()
    out = []
    for name, comment in found:
        try:
            meta = json.loads(comment or "")
        except ValueError:
            continue
        if isinstance(meta, dict) and {"sink_id", "table", "keys"} <= meta.keys():
            out.append((sql.Identifier(log_schema, name), meta))
    return out


# ---- the fence -----------------------------------------------------------------------------


class Fence:
    """A held session advisory lock for (sink, lineage); released by :meth:`close`.

    The lock lives as long as its connection: a crashed driver's fence disappears when
    PostgreSQL notices the connection is gone (TCP keepalives bound that time).
    """

    def __init__(self, conn: psycopg.Connection, description: str):
        self.conn, self.description = conn, description
        #: what recovery did when the fence was taken: {"committed": n, "rolled_back": m}
        self.recovered: dict[str, int] = {}

    def close(self) -> None:
        with suppress(psycopg.Error):
            self.conn.close()

    def __enter__(self) -> Fence:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Fence({self.description}, open={not self.conn.closed})"


# ---- the data source -----------------------------------------------------------------------


@dataclass
class _Prepared:
    gid: str
    batch: int
    partition: int
    attempt: int
    run: str


class PostgresDataSource(TwoPhaseCommitSink):
    """``df.writeStream.format("onceflow-postgres").option("dsn", ...).option("table", ...)``."""

    format_name = FORMAT
    required_options = ("dsn", "table")
    options_doc = {
        "dsn": "libpq DSN or URL; a password in it is moved to the 'password' option",
        "password": "password (Spark redacts options named like this in plans and logs)",
        "table": "target table, optionally schema-qualified (schema.table)",
        "mode": "two_phase (default; PREPARE TRANSACTION) or idempotent (rows + marker per task)",
        "write": "append (default) or upsert (INSERT ... ON CONFLICT (keys) DO UPDATE)",
        "keys": "comma-separated key columns (required for upsert)",
        "create_table": "true: create the table from the stream's schema if it is missing",
        "commit_deadline": "seconds to keep retrying while PostgreSQL is unreachable (default 60)",
        "connect_timeout": "seconds for one connection attempt (default 5)",
        "sink_id": "name of this sink, part of transaction ids and the commit log (default postgres)",
        "log_schema": "schema of onceflow's tables onceflow_commit_log / onceflow_markers (default public)",
    }

    def __init__(self, options):
        super().__init__(options)
        o = self.opts
        self.conninfo, inline_password = split_dsn(o["dsn"])
        self.password = o.get("password") or inline_password
        self.where = where(self.conninfo)
        self.mode = o.get("mode", "two_phase").lower()
        self.write_kind = o.get("write", "append").lower()
        self.keys = [k.strip() for k in o.get("keys", "").split(",") if k.strip()]
        self.create_table = o.get("create_table", "false").lower() in ("true", "1", "yes")
        self.sink_id = o.get("sink_id", "postgres")
        self.log_schema = o.get("log_schema", "public")
        try:
            self.commit_deadline = float(o.get("commit_deadline", 60))
            self.connect_timeout = max(2, int(float(o.get("connect_timeout", 5))))
        except ValueError:
            raise ConfigError(f"{FORMAT}: commit_deadline and connect_timeout must be numbers of seconds") from None
        if self.mode not in ("two_phase", "idempotent"):
            raise ConfigError(f"{FORMAT}: mode={self.mode!r}; use 'two_phase' or 'idempotent'")
        if self.write_kind not in ("append", "upsert"):
            raise ConfigError(f"{FORMAT}: write={self.write_kind!r}; use 'append' or 'upsert'")
        if self.write_kind == "upsert" and not self.keys:
            raise ConfigError(f"{FORMAT}: write=upsert needs keys, e.g. .option('keys', 'id')")
        if not _SINK_ID.match(self.sink_id):
            raise ConfigError(f"{FORMAT}: sink_id {self.sink_id!r}: use 1-64 letters, digits, '_', '-', '.'")
        schema, _, name = o["table"].rpartition(".")
        self.table_schema, self.table_name = schema or None, name
        self.table = sql.Identifier(*filter(None, (schema, name)))
        self.log_table = sql.Identifier(self.log_schema, "onceflow_commit_log")
        self.marker_table = sql.Identifier(self.log_schema, "onceflow_markers")
        digest = hashlib.sha1(f"{self.sink_id}:{o['table']}".encode()).hexdigest()[:16]
        self.stage_table = sql.Identifier(self.log_schema, f"onceflow_stage_{digest}")

    def __repr__(self) -> str:
        return f"PostgresDataSource({self.where}, table={self.opts['table']}, mode={self.mode}, sink_id={self.sink_id})"

    def describe_guarantee(self) -> str:
        if self.mode == "two_phase":
            return ("exactly-once (two_phase): each batch is prepared per task and committed after a "
                    "durable decision in onceflow_commit_log; a decided batch is never dropped")
        if self.write_kind == "upsert":
            return ("exactly-once effect (idempotent upsert): tasks commit staged rows with a marker; "
                    "the driver merges a decided batch into the table in one transaction")
        return ("exactly-once effect, weaker visibility (idempotent): tasks commit rows with a "
                "marker; a batch can be partly visible until it completes or is replayed")

    # ---- connections -------------------------------------------------------------------

    def _connect(self, purpose: str) -> psycopg.Connection:
        return psycopg.connect(
            self.conninfo, password=self.password, autocommit=True,
            connect_timeout=self.connect_timeout, application_name=f"onceflow-{purpose}",
        )

    def _connect_error(self, e: psycopg.OperationalError) -> ConfigError | SinkError:
        """The server refused us (ConfigError: fix the DSN) or is not reachable (SinkError: retry)."""
        text = self._safe(e)
        if re.search(r"authentication|does not exist|no pg_hba|permission denied|role ", text):
            return ConfigError(f"{FORMAT}: PostgreSQL at {self.where} refused the connection ({text}); check database, user and password")
        return SinkError(f"{FORMAT}: cannot reach PostgreSQL at {self.where} ({text}); check host and port, or wait until the server is up")

    def _safe(self, e: BaseException) -> str:
        return _scrub(str(e).strip(), self.password)

    def _retry(self) -> Retrying:
        return Retrying(
            retry=retry_if_exception_type(psycopg.OperationalError),
            stop=stop_after_delay(self.commit_deadline),
            wait=wait_exponential(multiplier=0.2, max=3),
            reraise=True,
        )

    def _unreachable(self, purpose: str, e: psycopg.OperationalError) -> SinkError:
        return SinkError(
            f"{FORMAT}: {purpose} failed, PostgreSQL at {self.where} unreachable for "
            f"{self.commit_deadline:g}s ({self._safe(e)}); restart the query when it is back: "
            "a decided batch is committed by recovery, an undecided one is replayed"
        )

    @contextmanager
    def _session(self, purpose: str) -> Iterator[psycopg.Connection]:
        """An autocommit connection, reused across calls in this process (one per thread).

        It goes back for reuse only when the block succeeded and left no transaction open; after
        any error it is closed, which also drops session-level advisory locks it may hold.
        A reused connection that the server dropped meanwhile fails its first statement with
        OperationalError, which :meth:`_retrying` answers with a fresh connection.
        """
        key = (self.conninfo, self.password, threading.get_ident())
        conn = _IDLE.pop(key, None)
        if conn is None or conn.closed:
            conn = self._connect(purpose)
        reusable = False
        try:
            yield conn
            reusable = not conn.closed and conn.info.transaction_status == TransactionStatus.IDLE
        finally:
            if reusable:
                _IDLE[key] = conn
            else:
                conn.close()

    def _retrying(self, purpose: str, fn: Callable[[psycopg.Connection], _R]) -> _R:
        """Run ``fn`` on a session; retry connection failures until commit_deadline."""
        try:
            for attempt in self._retry():
                with attempt, self._session(purpose) as conn:
                    return fn(conn)
        except psycopg.OperationalError as e:
            raise self._unreachable(purpose, e) from None
        raise AssertionError("unreachable")

    # ---- validation --------------------------------------------------------------------

    def validate(self, schema: T.StructType, overwrite: bool) -> None:
        """Reachability, prepared-transaction support, onceflow tables, target table and columns."""
        if overwrite:
            raise ConfigError(f"{FORMAT}: output mode 'complete' is not supported; use write=upsert with keys")
        try:
            conn = self._connect("validate")
        except psycopg.OperationalError as e:
            raise self._connect_error(e) from None
        with conn:
            if self.mode == "two_phase":
                mpt = int(conn.execute("SHOW max_prepared_transactions").fetchone()[0])
                if mpt <= 0:
                    raise ConfigError(
                        f"{FORMAT}: mode two_phase needs max_prepared_transactions > 0 but PostgreSQL at "
                        f"{self.where} has max_prepared_transactions = {mpt}; set it (e.g. 64, needs a "
                        "server restart) or use mode='idempotent' (exactly-once effect, weaker visibility)"
                    )
            self._ensure_log_tables(conn)
            self._check_table(conn, schema)
            if self.write_kind == "upsert":
                self._ensure_stage_table(conn, schema)

    def _ensure_log_tables(self, conn: psycopg.Connection) -> None:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", [_key("onceflow-ddl")])
            conn.execute(sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (sink text NOT NULL, lineage text NOT NULL, "
                "batch_id bigint NOT NULL, fingerprint text NOT NULL, handles jsonb NOT NULL, "
                "committed_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (sink, lineage, batch_id))"
            ).format(self.log_table))
            conn.execute(sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (sink text NOT NULL, lineage text NOT NULL, "
                "batch_id bigint NOT NULL, partition integer NOT NULL, rows bigint NOT NULL DEFAULT 0, "
                "written_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (sink, lineage, batch_id, partition))"
            ).format(self.marker_table))

    def _table_columns(self, conn: psycopg.Connection) -> dict[str, tuple[str, bool, bool]] | None:
        """column -> (formatted type, not null, has default); None when the table is missing."""
        name = self.opts["table"]
        oid = conn.execute("SELECT to_regclass(%s)::oid", [sql.Identifier(*name.split(".")).as_string(conn)]).fetchone()[0]
        if oid is None:
            return None
        rows = conn.execute(
            "SELECT attname, format_type(atttypid, atttypmod), attnotnull, atthasdef OR attidentity <> '' "
            "FROM pg_attribute WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped", [oid],
        ).fetchall()
        self._oid = oid
        return {r[0]: (r[1], r[2], r[3]) for r in rows}

    def _check_table(self, conn: psycopg.Connection, schema: T.StructType) -> None:
        want = {f.name: pg_type(f.dataType) for f in schema.fields}
        missing_keys = [k for k in self.keys if k not in want]
        if missing_keys:
            raise ConfigError(f"{FORMAT}: key column(s) {', '.join(missing_keys)} are not in the stream's columns {sorted(want)}")
        have = self._table_columns(conn)
        if have is None:
            if not self.create_table:
                raise ConfigError(
                    f"{FORMAT}: table {self.opts['table']} does not exist in {self.where}; create it, "
                    "or set create_table=True to create it from the stream's schema"
                )
            cols = [sql.SQL("{} {}").format(sql.Identifier(n), sql.SQL(t)) for n, t in want.items()]
            if self.keys:
                cols.append(sql.SQL("PRIMARY KEY ({})").format(sql.SQL(", ").join(map(sql.Identifier, self.keys))))
            conn.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(self.table, sql.SQL(", ").join(cols)))
            log.info("%s: created table %s in %s", FORMAT, self.opts["table"], self.where)
            return
        problems = [f"{n} (not in the table)" for n in want if n not in have]
        problems += [
            f"{n} (stream {want[n]}, table {have[n][0]})"
            for n in want if n in have and not _type_ok(want[n], have[n][0])
        ]
        problems += [
            f"{n} (table column NOT NULL without default, not in the stream)"
            for n, (_, notnull, has_default) in have.items() if n not in want and notnull and not has_default
        ]
        if problems:
            raise ConfigError(
                f"{FORMAT}: the stream's columns do not match table {self.opts['table']}: "
                f"{'; '.join(problems)}. Select/cast columns in the transform or alter the table"
            )
        if self.write_kind == "upsert":
            unique_sets = conn.execute(
                "SELECT array_agg(a.attname ORDER BY a.attname) FROM pg_index i "
                "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
                "WHERE i.indrelid = %s AND i.indisunique AND i.indpred IS NULL GROUP BY i.indexrelid",
                [self._oid],
            ).fetchall()
            if sorted(self.keys) not in [r[0] for r in unique_sets]:
                raise ConfigError(
                    f"{FORMAT}: upsert on keys ({', '.join(self.keys)}) needs a primary key or unique "
                    f"index on exactly those columns of {self.opts['table']}"
                )

    @staticmethod
    def _column_types(conn: psycopg.Connection, table: sql.Identifier) -> dict[str, str] | None:
        """column -> formatted type of an existing table; None when it does not exist."""
        oid = conn.execute("SELECT to_regclass(%s)::oid", [table.as_string(conn)]).fetchone()[0]
        if oid is None:
            return None
        return dict(conn.execute(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
            "WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped ORDER BY attnum", [oid],
        ).fetchall())

    def _stage_constraints(self, conn: psycopg.Connection, names: list[str]) -> dict[str, list]:
        """The table's NOT NULL stream columns and its CHECK constraints [name, definition] that
        involve stream columns only: what the staging table repeats."""
        oid = conn.execute("SELECT to_regclass(%s)::oid", [self.table.as_string(conn)]).fetchone()[0]
        not_null = [n for (n,) in conn.execute(
            "SELECT attname::text FROM pg_attribute WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped "
            "AND attnotnull AND attname::text = ANY(%s) ORDER BY attnum", [oid, names])]
        checks = [list(r) for r in conn.execute(
            "SELECT c.conname::text, pg_get_constraintdef(c.oid) FROM pg_constraint c "
            "WHERE c.conrelid = %s AND c.contype = 'c' AND COALESCE((SELECT array_agg(a.attname::text) "
            "FROM pg_attribute a WHERE a.attrelid = c.conrelid AND a.attnum = ANY(c.conkey)), '{}') <@ %s::text[] "
            "ORDER BY 1", [oid, names])]
        return {"not_null": not_null, "checks": checks}

    def _stage_busy(self, conn: psycopg.Connection) -> str:
        """Why the staging table must not be dropped now ('' if it may): staged rows, or prepared
        transactions of this sink or holding locks on it (their rows are invisible to count(*))."""
        pending = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(self.stage_table)).fetchone()[0]
        prepared, locked = conn.execute(
            "SELECT count(*), EXISTS (SELECT 1 FROM pg_locks WHERE relation = %s::regclass AND pid IS NULL) "
            "FROM pg_prepared_xacts WHERE database = current_database() AND starts_with(gid, %s)",
            [self.stage_table.as_string(conn), f"onceflow:{self.sink_id}:"],
        ).fetchone()
        parts = [f"{pending} staged row(s)"] * bool(pending) + [f"{prepared} prepared transaction(s) of sink {self.sink_id}"] * bool(prepared)
        return "; ".join(parts + ["a prepared transaction holding a lock on it"] * (locked and not prepared))

    def _ensure_stage_table(self, conn: psycopg.Connection, schema: T.StructType) -> None:
        """The upsert staging table: STAGE_COLUMNS plus the stream's columns with the table's types,
        NOT NULL and CHECK constraints (:meth:`_stage_constraints`), so a row the merge would refuse
        for those fails its task before the batch is decided.

        It is recreated when the stream's columns or the table's constraints changed, but only
        while no batch is staged or prepared (else: ConfigError for changed columns; the old
        constraints stay until then for changed constraints). DDL waits at most 10s for locks.
        """
        target = self._column_types(conn, self.table) or {}
        want = STAGE_COLUMNS | {n: target[n] for n in schema.names}
        meta = {"sink_id": self.sink_id, "table": self.opts["table"], "keys": self.keys,
                **self._stage_constraints(conn, schema.names)}
        name = self.stage_table.as_string(conn)
        try:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", [_key("onceflow-ddl")])
                conn.execute("SET LOCAL lock_timeout = '10s'")
                have = self._column_types(conn, self.stage_table)
                if have is not None and (have != want or _stage_meta(conn, name) != meta):
                    busy = self._stage_busy(conn)
                    if busy and have != want:
                        raise ConfigError(
                            f"{FORMAT}: staging table {name} holds an unfinished batch ({busy}) written with "
                            "other columns than the stream's; run the job once more with its previous columns "
                            "(or 'onceflow doctor --postgres DSN --resolve' with the job stopped) so recovery "
                            "applies it, then change them"
                        )
                    if busy:
                        log.warning("%s: the constraints of table %s changed; staging table %s keeps the old "
                                    "ones until its unfinished batch (%s) is merged", FORMAT, self.opts["table"], name, busy)
                    else:
                        conn.execute(sql.SQL("DROP TABLE {}").format(self.stage_table))
                        have = None
                if have is None:
                    self._create_stage_table(conn, schema.names, meta)
        except psycopg.errors.LockNotAvailable:
            raise SinkError(
                f"{FORMAT}: staging table {name} or table {self.opts['table']} stayed locked for 10s (another "
                "session or a prepared transaction uses it); stop the other job of this sink, or resolve "
                "prepared transactions with 'onceflow doctor --postgres DSN --resolve', then restart"
            ) from None

    def _create_stage_table(self, conn: psycopg.Connection, names: list[str], meta: dict[str, Any]) -> None:
        conn.execute(sql.SQL("CREATE TABLE {} AS SELECT {}, {} FROM {} WITH NO DATA").format(
            self.stage_table,
            sql.SQL(", ").join(sql.SQL("NULL::{} AS {}").format(sql.SQL(t), sql.Identifier(n))
                               for n, t in STAGE_COLUMNS.items()),
            sql.SQL(", ").join(map(sql.Identifier, names)), self.table,
        ))
        alter = [sql.SQL("ALTER COLUMN {} SET NOT NULL").format(sql.Identifier(n)) for n in meta["not_null"]]
        alter += [sql.SQL("ADD CONSTRAINT {} {}").format(sql.Identifier(c), sql.SQL(d)) for c, d in meta["checks"]]
        if alter:
            conn.execute(sql.SQL("ALTER TABLE {} {}").format(self.stage_table, sql.SQL(", ").join(alter)))
        conn.execute(sql.SQL("COMMENT ON TABLE {} IS {}").format(self.stage_table, sql.Literal(json.dumps(meta))))

    def _merge(self, conn: psycopg.Connection, lineage: str, batch: int,
               stage: tuple[sql.Identifier, sql.Identifier, list[str]] | None = None) -> int:
        """Upsert: move batch N's staged rows into the table in one statement; idempotent.

        The last row per key wins, in (partition, position in the partition) order. A second
        run finds nothing staged (the first one's DELETE is committed with its INSERT).
        ``stage``: (staging table, target table, keys), default this sink's.
        """
        st, table, keys = stage or (self.stage_table, self.table, self.keys)
        cols = [n for n in self._column_types(conn, st) or {} if n not in STAGE_COLUMNS]
        if not cols:
            return 0
        others = [c for c in cols if c not in keys]
        key_list = sql.SQL(", ").join(map(sql.Identifier, keys))
        action = (
            sql.SQL("DO UPDATE SET {}").format(sql.SQL(", ").join(
                sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(c)) for c in others))
            if others else sql.SQL("DO NOTHING")
        )
        try:
            cur = conn.execute(sql.SQL(
                "WITH staged AS (DELETE FROM {st} WHERE _onceflow_lineage = %s AND _onceflow_batch = %s RETURNING *) "
                "INSERT INTO {t} ({cols}) SELECT DISTINCT ON ({keys}) {cols} FROM staged "
                "ORDER BY {keys}, _onceflow_partition DESC, _onceflow_seq DESC ON CONFLICT ({keys}) {action}"
            ).format(st=st, t=table, cols=sql.SQL(", ").join(map(sql.Identifier, cols)),
                     keys=key_list, action=action), [lineage, batch])
        except psycopg.OperationalError:
            raise  # unreachable server: retried
        except psycopg.DatabaseError as e:
            raise SinkError(
                f"{FORMAT}: merging decided batch {batch} of lineage {lineage} into table "
                f"{table.as_string(conn)} failed: {e.diag.message_primary}; the batch stays staged in "
                f"{st.as_string(conn)} and every recovery retries it: fix the row there, the row it references, "
                "or the table's constraint (foreign keys are only checked at the merge), then restart the job or run "
                "'onceflow doctor --postgres DSN --resolve'"
            ) from None
        return cur.rowcount

    def _stages(self, conn: psycopg.Connection) -> list[tuple[sql.Identifier, sql.Identifier, list[str]]]:
        """(staging table, target table, keys) of this sink_id's upsert staging tables."""
        return [(st, sql.Identifier(*meta["table"].split(".")), meta["keys"])
                for st, meta in stage_tables(conn, self.log_schema) if meta["sink_id"] == self.sink_id]

    def _merge_decided(self, conn: psycopg.Connection, lineage: str) -> int:
        """Upsert recovery: merge every decided batch of the lineage that still has staged rows."""
        merged = 0
        for stage in self._stages(conn):
            staged = [b for (b,) in conn.execute(sql.SQL(
                "SELECT DISTINCT _onceflow_batch FROM {} WHERE _onceflow_lineage = %s ORDER BY 1").format(stage[0]),
                [lineage])]
            decided = self._decided_gids(conn, lineage, set(staged)) if staged else {}
            for b in staged:
                if b in decided:
                    self._merge(conn, lineage, b, stage)
                    merged += 1
        return merged

    # ---- the fence and recovery --------------------------------------------------------

    def open(self, lineage: str) -> Fence:
        """Acquire the fence for this lineage and recover; keep the returned Fence open for the run.

        Raises FencedError when another driver holds it.
        """
        description = f"sink {self.sink_id!r} lineage {lineage} at {self.where}"
        try:
            conn = psycopg.connect(
                self.conninfo, password=self.password, autocommit=True, connect_timeout=self.connect_timeout,
                application_name=f"onceflow-fence:{self.sink_id}:{lineage}"[:63],
                keepalives=1, keepalives_idle=10, keepalives_interval=5, keepalives_count=3,
            )
        except psycopg.OperationalError as e:
            raise self._connect_error(e) from None
        key = _key("onceflow-fence", self.sink_id, lineage)
        if not conn.execute("SELECT pg_try_advisory_lock(%s)", [key]).fetchone()[0]:
            holder = conn.execute(
                "SELECT a.pid, a.client_addr, a.backend_start FROM pg_locks l JOIN pg_stat_activity a "
                "USING (pid) WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 "
                "AND l.classid = %s::oid AND l.objid = %s::oid",
                [(key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF],
            ).fetchone()
            conn.close()
            who = f" (backend pid {holder[0]}, client {holder[1]}, since {holder[2]:%Y-%m-%d %H:%M:%S})" if holder else ""
            raise FencedError(
                f"{FORMAT}: another driver is running {description}{who}; stop it first. "
                "If it died, its fence is released as soon as PostgreSQL drops its connection"
            )
        fence = Fence(conn, description)
        try:
            counts = self.recover(lineage)
        except BaseException:
            fence.close()
            raise
        if any(counts.values()):
            log.warning("%s recovery for %s: %s", FORMAT, description, counts)
        fence.recovered = counts
        return fence

    def _prefix(self, lineage: str) -> str:
        return f"onceflow:{self.sink_id}:{lineage}:"

    @staticmethod
    def _prepared(conn: psycopg.Connection, prefix: str) -> list[_Prepared]:
        rows = conn.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() AND starts_with(gid, %s)",
            [prefix],
        ).fetchall()
        out = []
        for (gid,) in rows:
            m = GID.match(gid)
            if m:
                out.append(_Prepared(gid, int(m["batch"]), int(m["partition"]), int(m["attempt"]), m["run"]))
        return out

    def _decided_gids(self, conn: psycopg.Connection, lineage: str, batches: set[int]) -> dict[int, set[str]]:
        try:
            rows = conn.execute(
                sql.SQL("SELECT batch_id, handles FROM {} WHERE sink = %s AND lineage = %s AND batch_id = ANY(%s)").format(self.log_table),
                [self.sink_id, lineage, sorted(batches)],
            ).fetchall()
        except psycopg.errors.UndefinedTable:  # no commit log yet: nothing was ever decided here
            return {}
        return {b: {h["gid"] for h in handles if isinstance(h, dict) and "gid" in h} for b, handles in rows}

    def _finish(self, conn: psycopg.Connection, verb: str, gid: str) -> bool:
        """COMMIT/ROLLBACK PREPARED; False when the gid is no longer prepared."""
        try:
            conn.execute(sql.SQL(verb + " PREPARED {}").format(sql.Literal(gid)))
            return True
        except psycopg.errors.UndefinedObject:
            return False

    def _rollback_undecided(self, conn: psycopg.Connection, lineage: str, candidates: list[_Prepared]) -> int:
        """Roll back candidates that no decision lists, holding the lineage's decision lock."""
        if not candidates:
            return 0
        lock = _key("onceflow-decide", self.sink_id, lineage)
        conn.execute("SELECT pg_advisory_lock(%s)", [lock])
        try:
            decided = self._decided_gids(conn, lineage, {c.batch for c in candidates})
            return sum(
                self._finish(conn, "ROLLBACK", c.gid)
                for c in candidates if c.gid not in decided.get(c.batch, set())
            )
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", [lock])

    def _latest_planned_batch(self) -> int | None:
        loc = self.opts.get("checkpointlocation")
        if not loc:
            return None
        from onceflow.checkpoint.layout import CheckpointDir

        batches = CheckpointDir(loc).offset_batches()
        return batches[-1] if batches else None

    def recover(self, lineage: str, in_flight: Sequence[Any] = ()) -> dict[str, int]:
        """Commit prepared gids listed in a decision; roll back the others, except ``in_flight``.

        Without ``in_flight`` (called from :meth:`open`, maybe while the query already runs), the
        undecided gids of the checkpoint's latest planned batch are left alone: that batch may be
        running; its tasks and its commit clean up its stale attempts.
        """
        keep = {h["gid"] for h in in_flight if isinstance(h, dict) and "gid" in h}
        latest = None if keep else self._latest_planned_batch()

        def run(conn: psycopg.Connection) -> dict[str, int]:
            committed = rolled_back = 0
            prepared = [p for p in self._prepared(conn, self._prefix(lineage)) if p.gid not in keep]
            if prepared:
                decided = self._decided_gids(conn, lineage, {p.batch for p in prepared})
                committed = sum(
                    self._finish(conn, "COMMIT", p.gid) for p in prepared if p.gid in decided.get(p.batch, set())
                )
                stale = [
                    p for p in prepared
                    if p.gid not in decided.get(p.batch, set())
                    and (latest is None or p.batch < latest or p.batch in decided)
                ]
                rolled_back = self._rollback_undecided(conn, lineage, stale)
            # after the COMMIT PREPAREDs: every decided batch's rows are staged
            merged = self._merge_decided(conn, lineage)
            counts = {"committed": committed, "rolled_back": rolled_back}
            return counts | ({"merged": merged} if merged or self.write_kind == "upsert" else {})

        return self._retrying("recovery", run)

    # ---- tasks -------------------------------------------------------------------------

    def is_decided(self, lineage: str, batch_id: int) -> bool:
        return self._retrying("decision lookup", lambda conn: self._is_decided(conn, lineage, batch_id))

    def _is_decided(self, conn: psycopg.Connection, lineage: str, batch_id: int) -> bool:
        q = sql.SQL("SELECT 1 FROM {} WHERE sink = %s AND lineage = %s AND batch_id = %s").format(self.log_table)
        return conn.execute(q, [self.sink_id, lineage, batch_id]).fetchone() is not None

    def _write_rows(self, cur: psycopg.Cursor, task: TaskInfo, schema: T.StructType, batches: Iterator) -> int:
        """COPY the partition into the table (append) or the staging table (upsert)."""
        target, stage = (self.table, None) if self.write_kind == "append" else (
            self.stage_table, (task.lineage, task.batch_id, task.partition))
        types = self._column_types(cur.connection, target)
        if types is None:
            raise SinkError(f"{FORMAT}: table {target.as_string(cur)} vanished while the query runs; restart the query")
        try:
            return _copy(cur, target, schema.names, batches, types, stage)
        except psycopg.errors.DataError as e:
            where_ = re.sub(r"(column [^:]+):.*", r"\1", (e.diag.context or "").splitlines()[0] if e.diag.context else "")
            raise SinkError(
                f"{FORMAT}: a row of batch {task.batch_id} does not fit table {self.opts['table']}: "
                f"{e.diag.message_primary}{f' ({where_})' if where_ else ''}; widen the column or cast/truncate "
                "it in the transform (nothing of this batch was committed; it is replayed after the restart)"
            ) from None
        except psycopg.errors.IntegrityError as e:  # NOT NULL / CHECK (also repeated on the staging table)
            raise SinkError(
                f"{FORMAT}: a row of batch {task.batch_id} violates a constraint of table {self.opts['table']}: "
                f"{e.diag.message_primary}; fix the row in the transform or the constraint (nothing of this "
                "batch was committed or decided; it is replayed after the restart)"
            ) from None

    def pre_commit(self, task: TaskInfo, schema: T.StructType, overwrite: bool, batches: Iterator) -> tuple[Any, int]:
        run = _run_id()
        gid = f"onceflow:{self.sink_id}:{task.lineage}:{task.batch_id}:{task.partition}:{task.attempt}:{run}"
        if self.mode == "two_phase":  # also proves the session alive before any row is consumed
            self._retrying("task", lambda conn: self._clean_stale(conn, task, run))
        else:
            self._retrying("task", lambda conn: conn.execute("SELECT 1"))
        with self._session("task") as conn:
            if self.mode == "idempotent":
                return self._pre_commit_idempotent(conn, task, schema, batches)
            with conn.cursor() as cur:
                cur.execute("BEGIN")
                rows = self._write_rows(cur, task, schema, batches)
                if rows == 0:
                    cur.execute("ROLLBACK")
                    return None, 0
                xid = cur.execute("SELECT txid_current()").fetchone()[0]
                try:
                    cur.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
                except psycopg.Error as e:
                    if "prepared transactions" not in str(e):
                        raise
                    raise SinkError(
                        f"{FORMAT}: PostgreSQL at {self.where} has no free prepared-transaction slot "
                        f"({e.diag.message_primary}): {SLOT_RULE}; raise it (server restart), "
                        "coalesce() the stream to fewer partitions, or resolve dangling prepared "
                        "transactions (onceflow doctor --postgres DSN --resolve)"
                    ) from None
            # A decision recorded meanwhile cannot list this gid: do not leave it dangling.
            if self._is_decided(conn, task.lineage, task.batch_id):
                self._finish(conn, "ROLLBACK", gid)
                return None, 0
            return {"gid": gid, "xid": xid}, rows

    def _clean_stale(self, conn: psycopg.Connection, task: TaskInfo, run: str) -> None:
        """Roll back undecided gids of this lineage left by other runs or earlier attempts of
        this partition: they are dead, and their row locks would block an upsert."""
        prepared = self._prepared(conn, self._prefix(task.lineage))
        stale = [
            p for p in prepared
            if (p.run != run and run != "unknown")
            or (p.batch == task.batch_id and p.partition == task.partition and p.attempt != task.attempt)
        ]
        if stale:
            n = self._rollback_undecided(conn, task.lineage, stale)
            log.info("%s: rolled back %d stale prepared transaction(s) of %s", FORMAT, n, task.lineage)

    def _pre_commit_idempotent(self, conn, task: TaskInfo, schema, batches) -> tuple[Any, int]:
        with conn.transaction(), conn.cursor() as cur:
            cur.execute("SELECT pg_advisory_xact_lock_shared(%s)", [_key("onceflow-decide", self.sink_id, task.lineage)])
            if self._is_decided(conn, task.lineage, task.batch_id):
                return None, 0
            ident = [self.sink_id, task.lineage, task.batch_id, task.partition]
            fresh = cur.execute(sql.SQL(
                "INSERT INTO {} (sink, lineage, batch_id, partition) VALUES (%s, %s, %s, %s) "
                "ON CONFLICT DO NOTHING RETURNING 1").format(self.marker_table), ident).fetchone()
            if fresh is None:  # an earlier attempt committed this partition
                done = cur.execute(sql.SQL(
                    "SELECT rows FROM {} WHERE sink = %s AND lineage = %s AND batch_id = %s AND partition = %s"
                ).format(self.marker_table), ident).fetchone()[0]
                return {"partition": task.partition, "rows": done}, done
            rows = self._write_rows(cur, task, schema, batches)
            cur.execute(sql.SQL(
                "UPDATE {} SET rows = %s WHERE sink = %s AND lineage = %s AND batch_id = %s AND partition = %s"
            ).format(self.marker_table), [rows, *ident])
        return {"partition": task.partition, "rows": rows}, rows

    # ---- driver ------------------------------------------------------------------------

    def decision(self, lineage: str, batch_id: int) -> Decision | None:
        """The recorded decision, or None (also when the commit log does not exist yet)."""
        def run(conn: psycopg.Connection) -> Decision | None:
            try:
                row = conn.execute(
                    sql.SQL("SELECT fingerprint, handles FROM {} WHERE sink = %s AND lineage = %s AND batch_id = %s").format(self.log_table),
                    [self.sink_id, lineage, batch_id],
                ).fetchone()
            except psycopg.errors.UndefinedTable:  # no commit log yet: nothing was ever decided here
                return None
            return None if row is None else Decision(lineage, batch_id, row[0], list(row[1]))

        return self._retrying("decision lookup", run)

    def decide(self, decision: Decision, schema: T.StructType, overwrite: bool) -> None:
        """Record the decision, atomically checking (two_phase) that every gid is still prepared."""
        lineage, batch = decision.lineage, decision.batch_id
        handles = [h for h in decision.handles if h]

        def run(conn: psycopg.Connection) -> None:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", [_key("onceflow-decide", self.sink_id, lineage)])
                if self.mode == "two_phase" and handles:
                    gids = [h["gid"] for h in handles]
                    present = {r[0] for r in conn.execute("SELECT gid FROM pg_prepared_xacts WHERE gid = ANY(%s)", [gids])}
                    gone = [g for g in gids if g not in present]
                    if gone and self._is_decided(conn, lineage, batch):
                        return  # our own earlier attempt (connection lost after COMMIT) decided it
                    if gone:
                        raise SinkError(
                            f"{FORMAT}: batch {batch} of {lineage} not decided: prepared transaction(s) "
                            f"{', '.join(gone)} vanished (rolled back by an operator or another driver); "
                            "the query fails and the batch is replayed"
                        )
                conn.execute(sql.SQL(
                    "INSERT INTO {} (sink, lineage, batch_id, fingerprint, handles) VALUES (%s, %s, %s, %s, %s) "
                    "ON CONFLICT DO NOTHING").format(self.log_table),
                    [self.sink_id, lineage, batch, decision.fingerprint, json.dumps(handles)],
                )
                if self.mode == "idempotent":
                    conn.execute(sql.SQL("DELETE FROM {} WHERE sink = %s AND lineage = %s AND batch_id = %s").format(self.marker_table),
                                 [self.sink_id, lineage, batch])

        self._retrying("decide", run)

    def commit(self, decision: Decision) -> None:
        """COMMIT PREPARED every decided gid still prepared; roll back the batch's other gids;
        for upsert, then merge the batch's staged rows into the table (one local transaction).

        Retries while PostgreSQL is unreachable until commit_deadline, then raises SinkError.
        """
        handles = [h for h in decision.handles if h]
        lineage, batch = decision.lineage, decision.batch_id
        if self.mode == "idempotent":  # rows (append) or staged rows (upsert) were committed by the tasks
            if self.write_kind == "upsert":
                self._retrying("commit", lambda conn: self._merge(conn, lineage, batch))
            return

        def run(conn: psycopg.Connection) -> None:
            done = 0
            for h in handles:
                if self._finish(conn, "COMMIT", h["gid"]):
                    done += 1
                else:
                    status = conn.execute("SELECT txid_status(%s)", [h["xid"]]).fetchone()[0]
                    if status == "aborted":
                        raise SinkError(
                            f"{FORMAT}: decided transaction {h['gid']} of batch {batch} was rolled back "
                            "outside onceflow; its rows are lost, restore from a savepoint"
                        )
                if done == 1 and len(handles) >= 2:
                    maybe_crash("mid_commit", batch, None, self.opts)
            keep = {h["gid"] for h in handles}
            for p in self._prepared(conn, f"{self._prefix(lineage)}{batch}:"):
                if p.gid not in keep:
                    self._finish(conn, "ROLLBACK", p.gid)
            if self.write_kind == "upsert":
                self._merge(conn, lineage, batch)

        self._retrying("commit", run)

    def abort(self, lineage: str, batch_id: int, handles: list[Any]) -> None:
        if self.mode == "idempotent":
            return  # committed partitions stay; the replay skips them through their markers
        gids = {h["gid"] for h in handles if h}
        if not gids:
            return

        def run(conn: psycopg.Connection) -> int:
            prepared = [p for p in self._prepared(conn, f"{self._prefix(lineage)}{batch_id}:") if p.gid in gids]
            return self._rollback_undecided(conn, lineage, prepared)

        self._retrying("abort", run)


def _run_id() -> str:
    """Spark's run id of the streaming query (its job group), or 'unknown'."""
    from pyspark import TaskContext

    tc = TaskContext.get()
    value = tc.getLocalProperty("spark.jobGroup.id") if tc else None
    return (value or "unknown").lower()


# ---- user-facing configuration -------------------------------------------------------------


@dataclass(repr=False)
class PostgresSink(Sink):
    """Exactly-once PostgreSQL sink for a :class:`~onceflow.Job` (or ``writeStream``).

    ``mode``: ``two_phase`` (atomic batches, needs max_prepared_transactions > 0, one slot per
    write partition) or ``idempotent`` (rows + marker per task; an append batch can be partly
    visible for a moment). ``write``: ``append`` or ``upsert`` on ``keys`` (staged by the tasks,
    merged atomically by the driver; within a batch the last row per key in (partition,
    position) order wins). ``commit_deadline``: seconds a commit keeps
    retrying an unreachable server before the query fails (recovery finishes it later).
    """

    dsn: str
    table: str
    mode: Literal["two_phase", "idempotent"] = "two_phase"
    write: Literal["append", "upsert"] = "append"
    keys: tuple[str, ...] | list[str] = field(default_factory=tuple)
    create_table: bool = False
    commit_deadline: float = 60.0
    sink_id: str = "postgres"

    format_name = FORMAT

    def options(self) -> dict[str, str]:
        conninfo, password = split_dsn(self.dsn)
        opts = {
            "dsn": conninfo, "table": self.table, "mode": self.mode, "write": self.write,
            "create_table": str(bool(self.create_table)).lower(),
            "commit_deadline": str(self.commit_deadline), "sink_id": self.sink_id,
        }
        if self.keys:
            opts["keys"] = ",".join([self.keys] if isinstance(self.keys, str) else self.keys)
        if password:
            opts["password"] = password
        return opts

    def __repr__(self) -> str:
        return (
            f"PostgresSink(dsn={mask_dsn(self.dsn)!r}, table={self.table!r}, mode={self.mode!r}, "
            f"write={self.write!r}, keys={tuple(self.keys)!r}, sink_id={self.sink_id!r})"
        )

    __str__ = __repr__
