"""Epoch fencing of the PostgreSQL sink: a paused or dead driver can never make anything visible.

The epoch of (sink, lineage) is a row of ``<log_schema>.onceflow_epochs``. Every connection the
sink opens for a lineage (driver and tasks) carries the application_name
``of:<tag>:e<epoch>:<role>`` (``<tag>``: 16 hex digits of a hash of sink_id and lineage; the
epoch part is missing where the epoch is not known, e.g. tasks of a plain writeStream), so
PostgreSQL can tell which backends belong to a lineage. Connections made before an epoch is
known and not tied to one lineage (validation, taking the epoch) use a neutral name.

Guarantees:

* :func:`acquire` returns a number strictly greater than every earlier epoch of (sink,
  lineage) and stores it. Before and after raising it, it terminates every other backend of this
  (sink, lineage): a driver paused by SIGSTOP, a GC pause, a VM freeze or a partition, or one on
  a dead host, keeps no open transaction, row lock or advisory lock that would block its
  successor (its TCP connection may look alive for hours). Prepared transactions survive the
  termination, which is what recovery expects: decided ones are rolled forward, the rest rolled
  back. A stuck session still holding the epoch row is terminated again until the row is free.
* :func:`check` compares the stored epoch with the caller's and raises FencedError (nothing
  changed) when they differ. With ``lock=True`` it reads the row ``FOR SHARE``, so inside a
  transaction the epoch cannot move until that transaction ends: the decision (and an
  idempotent task's rows and marker) is committed only while the caller's epoch is current.
"""

from __future__ import annotations

import hashlib
import logging
import time

import psycopg
from psycopg import sql

from onceflow.errors import SinkError
from onceflow.sinks.base import fenced
from onceflow.sinks.postgres.dsn import FORMAT

log = logging.getLogger(__name__)

EPOCH_TABLE = "onceflow_epochs"
#: how long taking the epoch waits for its row before terminating the holders again
LOCK_WAIT = "2s"


def advisory_key(*parts: str) -> int:
    """A signed 64-bit advisory-lock key."""
    return int.from_bytes(hashlib.sha256(":".join(parts).encode()).digest()[:8], "big", signed=True)


def lineage_tag(sink_id: str, lineage: str) -> str:
    """``of:<16 hex digits>``: the application_name prefix of every connection of (sink, lineage)."""
    return "of:" + hashlib.sha256(f"{sink_id}\0{lineage}".encode()).hexdigest()[:16]


def app_name(sink_id: str, lineage: str, epoch: int | None, purpose: str) -> str:
    """``of:<tag>:e<epoch>:<purpose>`` (``of:<tag>:<purpose>`` without an epoch), at most 63 characters."""
    parts = [lineage_tag(sink_id, lineage), *([f"e{epoch}"] if epoch is not None else []), purpose]
    return ":".join(parts)[:63]


def create_table(conn: psycopg.Connection, table: sql.Identifier) -> None:
    conn.execute(sql.SQL(
        "CREATE TABLE IF NOT EXISTS {} (sink text NOT NULL, lineage text NOT NULL, epoch bigint NOT NULL, "
        "taken_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (sink, lineage))"
    ).format(table))


def stored_epoch(conn: psycopg.Connection, table: sql.Identifier, sink_id: str, lineage: str,
                 lock: bool = False) -> int:
    """The stored epoch, 0 when none was ever taken. ``lock``: read it FOR SHARE (inside a
    transaction); without it, a missing table also answers 0 (autocommit connections only)."""
    q = sql.SQL("SELECT epoch FROM {} WHERE sink = %s AND lineage = %s" + (" FOR SHARE" if lock else "")).format(table)
    if lock:
        row = conn.execute(q, [sink_id, lineage]).fetchone()
    else:
        try:
            row = conn.execute(q, [sink_id, lineage]).fetchone()
        except psycopg.errors.UndefinedTable:
            return 0
    return int(row[0]) if row else 0


def check(conn: psycopg.Connection, table: sql.Identifier, sink_id: str, lineage: str, mine: int | None,
          what: str, lock: bool = False) -> int:
    """The stored epoch, which must be ``mine``; else FencedError naming both."""
    current = stored_epoch(conn, table, sink_id, lineage, lock)
    if current != mine:
        raise fenced(FORMAT, lineage, mine, current, what)
    return current


def backends(conn: psycopg.Connection, sink_id: str, lineage: str) -> list[tuple[int, str, str | None]]:
    """(pid, application_name, state) of the other backends of (sink, lineage) in this database."""
    return conn.execute(
        "SELECT pid, application_name, state FROM pg_stat_activity WHERE datname = current_database() "
        "AND starts_with(application_name, %s) AND pid <> pg_backend_pid() ORDER BY pid",
        [lineage_tag(sink_id, lineage) + ":"],
    ).fetchall()


def terminate(conn: psycopg.Connection, sink_id: str, lineage: str) -> int:
    """Terminate every other backend of (sink, lineage); returns how many were signalled."""
    n = 0
    for pid, name, state in backends(conn, sink_id, lineage):
        try:
            n += bool(conn.execute("SELECT pg_terminate_backend(%s)", [pid]).fetchone()[0])
        except psycopg.errors.InsufficientPrivilege:
            log.warning("%s: no permission to terminate backend %s (%s, %s) of an older driver of "
                        "lineage %s", FORMAT, pid, name, state, lineage)
        else:
            log.info("%s: terminated backend %s (%s, %s) of an older driver of lineage %s",
                     FORMAT, pid, name, state, lineage)
    return n


def acquire(conn: psycopg.Connection, table: sql.Identifier, sink_id: str, lineage: str, deadline: float) -> int:
    """Raise and return the epoch of (sink, lineage); see the module's guarantees.

    Raises SinkError when the epoch row stays locked for ``deadline`` seconds by a session that
    is not one of this sink's (nothing else should ever lock it).
    """
    terminate(conn, sink_id, lineage)
    give_up = time.monotonic() + deadline
    while True:
        try:
            with conn.transaction():
                conn.execute(f"SET LOCAL lock_timeout = '{LOCK_WAIT}'")
                epoch = conn.execute(sql.SQL(
                    "INSERT INTO {} AS e (sink, lineage, epoch) VALUES (%s, %s, 1) ON CONFLICT (sink, lineage) "
                    "DO UPDATE SET epoch = e.epoch + 1, taken_at = now() RETURNING epoch"
                ).format(table), [sink_id, lineage]).fetchone()[0]
            break
        except psycopg.errors.LockNotAvailable:
            if time.monotonic() > give_up:
                raise SinkError(
                    f"{FORMAT}: cannot take a new epoch for sink {sink_id} lineage {lineage}: its row in "
                    f"{table.as_string(conn)} stayed locked for {deadline:g}s by a session that is not this "
                    "sink's (every backend of this sink and lineage was terminated) or by a prepared "
                    "transaction; find the holder in pg_locks / pg_stat_activity, end it, then restart"
                ) from None
            terminate(conn, sink_id, lineage)  # a stuck old session took a lock meanwhile
    terminate(conn, sink_id, lineage)  # sessions that connected while the old epoch was current
    return int(epoch)

