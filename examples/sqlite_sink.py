"""A two-phase-commit sink of your own: append a stream to an SQLite table, exactly once.

The worked example of docs/custom-sink.md, which walks through this file. It is a sink module,
not a job: import it from a job file next to it and give it to a ``Job``::

    from sqlite_sink import SqliteSink
    job = Job(name="ids", source=..., sink=SqliteSink("/data/out.db", "events"), ...)

Guarantee (with a replayable source and a deterministic transform, as for every onceflow
sink): every batch's rows appear in ``<table>`` exactly once per lineage, through any crash,
replay, lost reply or paused ("zombie") driver. tests/sinks/test_conformance.py proves it
(case ``sqlite``). What lives in the database file:

* ``<table>``: the target; readers see a batch's rows only once the batch is committed.
* ``<table>_staged``: rows pre-committed by tasks, each tagged with its task's handle.
* ``onceflow_handles``: which (lineage, batch, epoch) each staged handle belongs to.
* ``onceflow_epochs``: the fencing epoch per (table, lineage).
* ``onceflow_decisions``: one row per decided batch: its handles, fingerprint, epoch, and
  whether it is committed.

Every step is one SQLite transaction (``BEGIN IMMEDIATE``: the write lock is taken first, so
what a step reads cannot change before it commits). Limit: SQLite locks a file for processes
on one machine, so this sink is for ``local[N]`` masters; and a process stopped *inside* a
transaction (none of this file's fault points is) holds the lock until it dies.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import sys
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import closing, contextmanager
from typing import Any, ClassVar

from pyspark import cloudpickle
from pyspark.sql.types import StructType

from onceflow.errors import ConfigError, FencedError
from onceflow.faults import maybe_crash
from onceflow.sinks.base import Decision, Sink, TaskInfo, TwoPhaseCommitSink, fenced

FORMAT = "example-sqlite"
#: Spark type -> SQLite column type; other types are refused when the query starts.
TYPES = {"LongType": "INTEGER", "IntegerType": "INTEGER", "ShortType": "INTEGER", "ByteType": "INTEGER",
         "BooleanType": "INTEGER", "DoubleType": "REAL", "FloatType": "REAL", "StringType": "TEXT",
         "BinaryType": "BLOB"}
BOOKKEEPING = """
CREATE TABLE IF NOT EXISTS onceflow_epochs (
    target TEXT, lineage TEXT, epoch INTEGER NOT NULL, PRIMARY KEY (target, lineage));
CREATE TABLE IF NOT EXISTS onceflow_decisions (
    target TEXT, lineage TEXT, batch INTEGER, fingerprint TEXT NOT NULL, epoch INTEGER,
    handles TEXT NOT NULL, committed INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (target, lineage, batch));
CREATE TABLE IF NOT EXISTS onceflow_handles (
    target TEXT, handle TEXT, lineage TEXT NOT NULL, batch INTEGER NOT NULL, epoch INTEGER,
    PRIMARY KEY (target, handle));
"""


def _connect(path: str) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit) that waits for locks."""
    conn = sqlite3.connect(path, timeout=120, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
    conn.execute("PRAGMA synchronous=FULL")  # a committed transaction survives a power cut
    return conn


@contextmanager
def _transaction(path: str) -> Iterator[sqlite3.Connection]:
    """One atomic, durable step: everything inside commits together or not at all."""
    with closing(_connect(path)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")


def _quote(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ConfigError(f"{FORMAT}: {name!r} is not a plain SQL identifier (letters, digits, _)")
    return f'"{name}"'


class SqliteDataSource(TwoPhaseCommitSink):
    """The Spark data source: the protocol's steps on one SQLite file (see the module doc)."""

    format_name = FORMAT
    options_doc: ClassVar[dict[str, str]] = {
        "database": "path of the SQLite database file (created if missing)",
        "table": "target table (created from the stream's schema if missing)",
    }
    required_options = ("database", "table")

    def __init__(self, options: Mapping[str, str]):
        super().__init__(options)
        self.db, self.table = self.opts["database"], self.opts["table"]
        self.target, self.staged = _quote(self.table), _quote(f"{self.table}_staged")

    # ---- set-up (driver, before the query starts) --------------------------------------

    def validate(self, schema: StructType, overwrite: bool) -> None:
        """Create the tables; refuse complete mode, unknown types and a differing table."""
        if overwrite:
            raise ConfigError(f"{FORMAT}: append only (outputMode 'complete' is not supported)")
        cols = []
        for f in schema.fields:
            kind = TYPES.get(type(f.dataType).__name__)
            if kind is None:
                raise ConfigError(f"{FORMAT}: column {f.name}: type {f.dataType.simpleString()} is not supported")
            cols.append(f"{_quote(f.name)} {kind}")
        with _transaction(self.db) as conn:
            for statement in filter(str.strip, BOOKKEEPING.split(";")):
                conn.execute(statement)
            conn.execute(f"CREATE TABLE IF NOT EXISTS {self.target} ({', '.join(cols)})")
            conn.execute(f"CREATE TABLE IF NOT EXISTS {self.staged} (_handle TEXT NOT NULL, {', '.join(cols)})")
            have = [r[1] for r in conn.execute(f"PRAGMA table_info({self.target})")]
        if have != schema.fieldNames():
            raise ConfigError(f"{FORMAT}: table {self.table} has columns {have}, the stream {schema.fieldNames()}")

    def acquire_epoch(self, lineage: str) -> int:
        """Raise the stored epoch of (table, lineage) by one, atomically; return it."""
        with _transaction(self.db) as conn:
            conn.execute("INSERT INTO onceflow_epochs VALUES (?, ?, 1) ON CONFLICT (target, lineage) "
                         "DO UPDATE SET epoch = epoch + 1", [self.table, lineage])
            epoch = self._stored_epoch(conn, lineage)
        assert epoch is not None  # the row this transaction wrote
        return epoch

    def _stored_epoch(self, conn: sqlite3.Connection, lineage: str) -> int | None:
        row = conn.execute("SELECT epoch FROM onceflow_epochs WHERE target = ? AND lineage = ?",
                           [self.table, lineage]).fetchone()
        return row[0] if row else None

    # ---- tasks (executors) --------------------------------------------------------------

    def is_decided(self, lineage: str, batch_id: int) -> bool:
        with closing(_connect(self.db)) as conn:
            return conn.execute("SELECT 1 FROM onceflow_decisions WHERE target = ? AND lineage = ? AND batch = ?",
                                [self.table, lineage, batch_id]).fetchone() is not None

    def pre_commit(self, task: TaskInfo, schema: StructType, overwrite: bool,
                   batches: Iterator) -> tuple[Any, int]:
        """Stage the partition's rows under a new handle, in one transaction; a task of an
        older epoch than the stored one stages nothing (FencedError)."""
        handle = f"{task.lineage}/{task.batch_id}/{task.partition}/{task.attempt}/{uuid.uuid4().hex[:12]}"
        mine = self.epoch
        names = ", ".join(_quote(n) for n in schema.fieldNames())
        marks = ", ".join("?" * (len(schema.fields) + 1))
        rows = 0
        with _transaction(self.db) as conn:
            stored = self._stored_epoch(conn, task.lineage)
            if mine is not None and stored is not None and stored > mine:
                raise fenced(FORMAT, task.lineage, mine, stored, f"pre-commit of batch {task.batch_id}")
            conn.execute("INSERT INTO onceflow_handles VALUES (?, ?, ?, ?, ?)",
                         [self.table, handle, task.lineage, task.batch_id, mine])
            for batch in batches:
                columns = [c.to_pylist() for c in batch.columns]
                conn.executemany(f"INSERT INTO {self.staged} (_handle, {names}) VALUES ({marks})",
                                 ((handle, *row) for row in zip(*columns, strict=True)))
                rows += batch.num_rows
        return handle, rows

    # ---- the driver's decision and commit ----------------------------------------------

    def decision(self, lineage: str, batch_id: int) -> Decision | None:
        with closing(_connect(self.db)) as conn:
            return self._decision(conn, lineage, batch_id)

    def _decision(self, conn: sqlite3.Connection, lineage: str, batch_id: int) -> Decision | None:
        row = conn.execute("SELECT fingerprint, handles, epoch FROM onceflow_decisions "
                           "WHERE target = ? AND lineage = ? AND batch = ?", [self.table, lineage, batch_id]).fetchone()
        return None if row is None else Decision(lineage, batch_id, row[0], json.loads(row[1]), row[2])

    def decide(self, decision: Decision, schema: StructType, overwrite: bool) -> None:
        """Record the decision in one transaction that also checks the epoch: an older epoch
        raises FencedError, a rival decision too, a retry of this very decision does nothing."""
        lineage, batch = decision.lineage, decision.batch_id
        with _transaction(self.db) as conn:
            stored = self._stored_epoch(conn, lineage)
            if stored != decision.epoch:
                raise fenced(FORMAT, lineage, decision.epoch, stored, f"decide of batch {batch}")
            existing = self._decision(conn, lineage, batch)
            if existing is not None:
                if existing.same_as(decision):
                    return  # our own earlier call committed; its reply was lost
                raise FencedError(f"{FORMAT}: batch {batch} of lineage {lineage} is already decided "
                                  f"by epoch {existing.epoch} with other handles or offsets; nothing recorded")
            conn.execute("INSERT INTO onceflow_decisions VALUES (?, ?, ?, ?, ?, ?, 0)",
                         [self.table, lineage, batch, decision.fingerprint, decision.epoch,
                          json.dumps(decision.handles or [])])

    def commit(self, decision: Decision) -> None:
        """Move the decided handles' rows into the table and mark the batch committed, in one
        transaction; a committed batch is left as it is (idempotent). Every other handle of
        the batch is dropped: none of them can ever be decided."""
        lineage, batch = decision.lineage, decision.batch_id
        with _transaction(self.db) as conn:
            row = conn.execute("SELECT handles, committed FROM onceflow_decisions WHERE target = ? "
                               "AND lineage = ? AND batch = ?", [self.table, lineage, batch]).fetchone()
            if row is None or row[1]:
                return  # nothing decided here, or already committed (a replay, a lost reply)
            names = ", ".join(r[1] for r in conn.execute(f"PRAGMA table_info({self.target})"))
            conn.execute(f"INSERT INTO {self.target} ({names}) SELECT {names} FROM {self.staged} "
                         "WHERE _handle IN (SELECT value FROM json_each(?))", [row[0]])
            maybe_crash("mid_commit", batch, None, self.opts)  # a raise here rolls all of it back
            self._drop(conn, "lineage = ? AND batch = ?", [lineage, batch])
            conn.execute("UPDATE onceflow_decisions SET committed = 1 WHERE target = ? AND lineage = ? "
                         "AND batch = ?", [self.table, lineage, batch])

    def abort(self, lineage: str, batch_id: int, handles: list[Any]) -> None:
        """Drop these handles' staged rows, unless their batch is decided (commit owns them)."""
        with _transaction(self.db) as conn:
            if self._decision(conn, lineage, batch_id) is None:
                self._drop(conn, "handle IN (SELECT value FROM json_each(?))", [json.dumps(handles)])

    def _drop(self, conn: sqlite3.Connection, where: str, args: list[Any]) -> int:
        """Delete the staged rows and entries of the handles ``where`` selects; their count."""
        select = f"SELECT handle FROM onceflow_handles WHERE target = ? AND {where}"
        conn.execute(f"DELETE FROM {self.staged} WHERE _handle IN ({select})", [self.table, *args])
        return conn.execute(f"DELETE FROM onceflow_handles WHERE handle IN ({select})",
                            [self.table, *args]).rowcount

    def recover(self, lineage: str, in_flight: Sequence[Any] = ()) -> dict[str, int]:
        """Commit every decided, uncommitted batch; drop the handles of undecided batches
        staged by this epoch or an older one (never ``in_flight``, never a newer epoch's)."""
        with closing(_connect(self.db)) as conn:
            pending = [r[0] for r in conn.execute(
                "SELECT batch FROM onceflow_decisions WHERE target = ? AND lineage = ? AND committed = 0 "
                "ORDER BY batch", [self.table, lineage])]
        for batch in pending:
            decided = self.decision(lineage, batch)
            if decided is not None:
                self.commit(decided)
        mine = self.epoch
        with _transaction(self.db) as conn:
            dropped = self._drop(
                conn, "lineage = ? AND (epoch IS NULL OR ? IS NULL OR epoch <= ?) "
                "AND handle NOT IN (SELECT value FROM json_each(?)) AND batch NOT IN "
                "(SELECT batch FROM onceflow_decisions WHERE target = ? AND lineage = ?)",
                [lineage, mine, mine, json.dumps(list(in_flight)), self.table, lineage])
        return {"rolled_forward": len(pending), "rolled_back": dropped}

    def describe_guarantee(self) -> str:
        return "exactly-once, append: staged rows move into the table in the transaction that marks the batch done"


class SqliteSink(Sink):
    """``SqliteSink(database, table)`` for a ``Job`` (or ``write_stream`` in plain Spark code)."""

    format_name = FORMAT

    def __init__(self, database: str, table: str):
        _quote(table)
        self.database, self.table = os.path.abspath(database), table

    def options(self) -> dict[str, str]:
        return {"database": self.database, "table": self.table}

    def data_source(self, extra: Mapping[str, str] | None = None) -> TwoPhaseCommitSink:
        """This sink's data source (onceflow's own sinks are looked up in its registry)."""
        return SqliteDataSource({**self.options(), **(extra or {})})

    def stream_writer(self, df: Any, source: TwoPhaseCommitSink, options: Mapping[str, str],
                      overwrite: bool) -> Any:
        """Register the data source with the session (``onceflow.spark.register_all`` knows
        only onceflow's own), then write with it."""
        df.sparkSession.dataSource.register(SqliteDataSource)
        return super().stream_writer(df, source, options, overwrite)


# Spark's Python workers import pickled classes by module name, and this file's directory is
# on the driver's path only: ship this module's classes by value instead.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
