"""The Spark data source ``onceflow-postgres``: two-phase commit per micro-batch into PostgreSQL.

Steps (docs/protocol.md): tasks pre-commit (two_phase: COPY + ``PREPARE TRANSACTION`` under
a gid ``onceflow:<sink>:<lineage>:<batch>:<partition>:<attempt>:e<epoch>:<run>``; idempotent:
rows + a marker in one local transaction); the driver records the decision (batch, fingerprint,
handles, epoch) in ``onceflow_commit_log``, then commits (``COMMIT PREPARED``; upsert: merge).

Guarantees:

* A decision is recorded in one transaction that holds the lineage's decide lock and reads the
  stored epoch ``FOR SHARE``: it is written only while the caller's epoch is current (else
  FencedError, nothing written), and only if no decision of this batch exists or the existing
  one is this very decision (a retry); a rival decision raises FencedError, so the caller never
  commits its own gids. In two_phase it also checks that every listed gid is still prepared.
* A gid is rolled back only when no decision lists it, under the same decide lock after
  re-reading the decisions, and only by a holder of the current epoch (checked before and under
  the lock): so a decided gid is never rolled back, and a fenced driver rolls back nothing.
  Recovery and a task's clean-up roll back gids of older epochs (and, in a task, other attempts
  of its own partition in its own epoch), never gids of a newer epoch.
* ``COMMIT PREPARED`` of a decided gid and the merge of a decided upsert batch are roll-forward
  steps anyone may take; they need no epoch.
* A task of an older epoch raises FencedError before writing. An idempotent task's transaction
  (which IS visibility) commits its rows and marker only while its epoch is current (``FOR
  SHARE`` read in that transaction).
* An unreachable server is a SinkError (retried until ``commit_deadline`` first), never a
  ConfigError; errors are one line and never contain the password.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql
from pyspark.sql import types as T

from onceflow.errors import ConfigError, FencedError, SinkError
from onceflow.faults import maybe_crash
from onceflow.sinks.base import Decision, TwoPhaseCommitSink
from onceflow.sinks.postgres import fence, logtables
from onceflow.sinks.postgres.dsn import FORMAT, split_dsn, where
from onceflow.sinks.postgres.session import Sessions
from onceflow.sinks.postgres.stage import Staging
from onceflow.sinks.postgres.task import DEFAULT_LOCK_TIMEOUT, TaskWriter
from onceflow.sinks.postgres.types import Tables

log = logging.getLogger(__name__)

#: gids of this sink; ``e<epoch>`` is missing in gids written before epochs existed
GID = re.compile(
    r"^onceflow:(?P<sink>[A-Za-z0-9_.-]+):(?P<lineage>[^:]+):(?P<batch>\d+):(?P<partition>\d+)"
    r":(?P<attempt>\d+)(?::e(?P<epoch>\d+))?:(?P<run>[0-9a-z-]+)$"
)
_SINK_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass
class _Prepared:
    gid: str
    batch: int
    partition: int
    attempt: int
    run: str
    epoch: int | None  # None: written before epochs existed (older than any)

    def older_than(self, epoch: int) -> bool:
        return self.epoch is None or self.epoch < epoch


def _handles(decision: Decision) -> list[Any]:
    return [h for h in decision.handles or [] if h]


class PostgresDataSource(TaskWriter, Tables, Staging, Sessions, TwoPhaseCommitSink):
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
        "lock_timeout": "seconds a task's transaction waits for a lock before it fails and is retried (default 10)",
        "sink_id": "name of this sink, part of transaction ids and the commit log (default postgres)",
        "log_schema": "schema of onceflow's tables onceflow_commit_log / onceflow_markers / onceflow_epochs (default public)",
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
            self.lock_timeout = float(o.get("lock_timeout", DEFAULT_LOCK_TIMEOUT))
        except ValueError:
            raise ConfigError(f"{FORMAT}: commit_deadline, connect_timeout and lock_timeout must be numbers of seconds") from None
        if not 0 < self.lock_timeout <= 86_400:
            raise ConfigError(f"{FORMAT}: lock_timeout={self.lock_timeout:g}: give seconds between 0 and 86400 "
                              f"(default {DEFAULT_LOCK_TIMEOUT:g}); a task blocked longer fails and is retried")
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
        self.log_table = sql.Identifier(self.log_schema, logtables.COMMIT_LOG)
        self.marker_table = sql.Identifier(self.log_schema, logtables.MARKERS)
        self.epoch_table = sql.Identifier(self.log_schema, fence.EPOCH_TABLE)
        digest = hashlib.sha1(f"{self.sink_id}:{o['table']}".encode()).hexdigest()[:16]
        self.stage_table = sql.Identifier(self.log_schema, f"onceflow_stage_{digest}")
        #: what the last :meth:`recover` did: {"committed": n, "rolled_back": m[, "merged": k]}
        self.recovered: dict[str, int] = {}

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

    # ---- validation --------------------------------------------------------------------

    def validate(self, schema: T.StructType, overwrite: bool) -> None:
        """Reachability, prepared-transaction support, onceflow tables, target table and columns."""
        if overwrite:
            raise ConfigError(f"{FORMAT}: output mode 'complete' is not supported; use write=upsert with keys")
        try:
            conn = self._connect("validate")
        except psycopg.OperationalError as e:
            raise self._connect_error(e) from None
        try:
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
        except psycopg.errors.InsufficientPrivilege as e:
            raise self._refused(e) from None
        except psycopg.OperationalError as e:  # the server went away meanwhile
            raise SinkError(f"{FORMAT}: validation failed: PostgreSQL at {self.where} unreachable ({self._safe(e)})") from None

    def _refused(self, e: psycopg.Error) -> ConfigError:
        return ConfigError(
            f"{FORMAT}: PostgreSQL at {self.where} refused: {e.diag.message_primary}; grant the privilege "
            "(onceflow creates onceflow_commit_log, onceflow_markers and onceflow_epochs in log_schema) "
            "or create those tables beforehand"
        )

    def _ensure_log_tables(self, conn: psycopg.Connection) -> None:
        logtables.ensure(conn, self.log_schema)

    # ---- epochs and recovery -----------------------------------------------------------

    def acquire_epoch(self, lineage: str) -> int:
        """Raise the stored epoch of (sink, lineage) and return it, after terminating every
        other session of this sink and lineage (see :mod:`onceflow.sinks.postgres.fence`)."""
        def run(conn: psycopg.Connection) -> int:
            self._ensure_log_tables(conn)
            return fence.acquire(conn, self.epoch_table, self.sink_id, lineage, self.commit_deadline)

        try:
            epoch = self._retrying("open", run, role="open")
        except psycopg.errors.InsufficientPrivilege as e:
            raise self._refused(e) from None
        log.info("%s: sink %s lineage %s at %s opened with epoch %d", FORMAT, self.sink_id, lineage, self.where, epoch)
        return epoch

    def _check(self, conn: psycopg.Connection, lineage: str, mine: int | None, what: str, lock: bool = False) -> int:
        return fence.check(conn, self.epoch_table, self.sink_id, lineage, mine, what, lock)

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
                out.append(_Prepared(gid, int(m["batch"]), int(m["partition"]), int(m["attempt"]), m["run"],
                                     int(m["epoch"]) if m["epoch"] else None))
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

    def _rollback_undecided(self, conn: psycopg.Connection, lineage: str, candidates: list[_Prepared],
                            mine: int, what: str) -> int:
        """Roll back candidates that no decision lists, holding the lineage's decide lock, as the
        holder of epoch ``mine`` (checked before and under the lock; else FencedError)."""
        if not candidates:
            return 0
        self._check(conn, lineage, mine, what)  # a fenced caller never even takes the lock
        lock = fence.advisory_key("onceflow-decide", self.sink_id, lineage)
        conn.execute("SELECT pg_advisory_lock(%s)", [lock])
        try:
            self._check(conn, lineage, mine, what)
            decided = self._decided_gids(conn, lineage, {c.batch for c in candidates})
            return sum(
                self._finish(conn, "ROLLBACK", c.gid)
                for c in candidates if c.gid not in decided.get(c.batch, set())
            )
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", [lock])

    def recover(self, lineage: str, in_flight: Sequence[Any] = ()) -> dict[str, int]:
        """Commit prepared gids listed in a decision; roll back the undecided ones of this or
        older epochs, except ``in_flight``; merge decided upsert batches still staged.

        Without an epoch of its own (not opened: ``onceflow doctor --resolve`` beside a connected
        driver) it rolls back only gids of epochs older than the stored one, whose drivers are
        fenced, and leaves the current driver's alone.
        """
        keep = {h["gid"] for h in in_flight if isinstance(h, dict) and "gid" in h}

        def run(conn: psycopg.Connection) -> dict[str, int]:
            mine = self.epoch if self.epoch is not None else fence.stored_epoch(conn, self.epoch_table, self.sink_id, lineage)
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
                    and (p.older_than(mine) or (p.epoch == mine and self.epoch is not None))
                ]
                rolled_back = self._rollback_undecided(conn, lineage, stale, mine, "recovery") if stale else 0
            # after the COMMIT PREPAREDs: every decided batch's rows are staged
            merged = self._merge_decided(conn, lineage)
            counts = {"committed": committed, "rolled_back": rolled_back}
            return counts | ({"merged": merged} if merged or self.write_kind == "upsert" else {})

        self.recovered = self._retrying("recovery", run, lineage)
        return self.recovered

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

    # ---- driver ------------------------------------------------------------------------

    def _decision_row(self, conn: psycopg.Connection, lineage: str, batch_id: int) -> Decision | None:
        q = "SELECT fingerprint, handles, {epoch} FROM {} WHERE sink = %s AND lineage = %s AND batch_id = %s"
        args = [self.sink_id, lineage, batch_id]
        try:
            row = conn.execute(sql.SQL(q).format(self.log_table, epoch=sql.SQL("epoch")), args).fetchone()
        except psycopg.errors.UndefinedColumn:  # a commit log from before epochs (autocommit only)
            row = conn.execute(sql.SQL(q).format(self.log_table, epoch=sql.SQL("NULL::bigint")), args).fetchone()
        return None if row is None else Decision(lineage, batch_id, row[0], list(row[1]), row[2])

    def decision(self, lineage: str, batch_id: int) -> Decision | None:
        """The recorded decision (with its epoch), or None (also when the commit log does not exist yet)."""
        def run(conn: psycopg.Connection) -> Decision | None:
            try:
                return self._decision_row(conn, lineage, batch_id)
            except psycopg.errors.UndefinedTable:  # no commit log yet: nothing was ever decided here
                return None

        return self._retrying("decision lookup", run, lineage)

    def decide(self, decision: Decision, schema: T.StructType, overwrite: bool) -> None:
        """Record the decision in one transaction that checks, under the lineage's decide lock:
        the stored epoch (FOR SHARE) is the decision's, the batch is undecided or decided with
        this very decision, and (two_phase) every gid is still prepared."""
        lineage, batch, mine = decision.lineage, decision.batch_id, decision.epoch
        handles = _handles(decision)
        ours = Decision(lineage, batch, decision.fingerprint, handles, mine)

        def run(conn: psycopg.Connection) -> None:
            self._check(conn, lineage, mine, "decide")  # a fenced caller never even takes the lock
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", [fence.advisory_key("onceflow-decide", self.sink_id, lineage)])
                self._check(conn, lineage, mine, "decide", lock=True)
                existing = self._decision_row(conn, lineage, batch)
                if existing is not None:
                    if existing.same_as(ours):
                        return  # our own earlier attempt (connection lost after COMMIT) recorded it
                    raise self._rival(existing, ours)
                if self.mode == "two_phase" and handles:
                    gids = [h["gid"] for h in handles]
                    present = {r[0] for r in conn.execute("SELECT gid FROM pg_prepared_xacts WHERE gid = ANY(%s)", [gids])}
                    gone = [g for g in gids if g not in present]
                    if gone:
                        raise SinkError(
                            f"{FORMAT}: batch {batch} of {lineage} not decided: prepared transaction(s) "
                            f"{', '.join(gone)} vanished (rolled back by an operator or another driver); "
                            "the query fails and the batch is replayed"
                        )
                conn.execute(sql.SQL(
                    "INSERT INTO {} (sink, lineage, batch_id, fingerprint, handles, epoch) VALUES (%s, %s, %s, %s, %s, %s)"
                ).format(self.log_table), [self.sink_id, lineage, batch, decision.fingerprint, json.dumps(handles), mine])
                if self.mode == "idempotent":
                    conn.execute(sql.SQL("DELETE FROM {} WHERE sink = %s AND lineage = %s AND batch_id = %s").format(self.marker_table),
                                 [self.sink_id, lineage, batch])

        self._retrying("decide", run, lineage, epoch=mine)

    def _rival(self, existing: Decision, ours: Decision) -> FencedError:
        def what(d: Decision) -> str:
            return f"epoch {d.epoch}, fingerprint {d.fingerprint}, {len(d.handles or [])} handle(s)"

        return FencedError(
            f"{FORMAT}: decide refused: batch {ours.batch_id} of lineage {ours.lineage} (sink {self.sink_id}) "
            f"is already decided ({what(existing)}); this driver proposed a different decision "
            f"({what(ours)}). Nothing was recorded and none of this driver's transactions is committed; "
            "two drivers (or commit processes) ran the same lineage, this one stops"
        )

    def commit(self, decision: Decision) -> None:
        """COMMIT PREPARED every decided gid still prepared; roll back the batch's other gids;
        for upsert, then merge the batch's staged rows into the table (one local transaction).

        Retries while PostgreSQL is unreachable until commit_deadline, then raises SinkError.
        """
        handles = _handles(decision)
        lineage, batch = decision.lineage, decision.batch_id
        if self.mode == "idempotent":  # rows (append) or staged rows (upsert) were committed by the tasks
            if self.write_kind == "upsert":
                self._retrying("commit", lambda conn: self._merge(conn, lineage, batch), lineage)
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

        self._retrying("commit", run, lineage)

    def abort(self, lineage: str, batch_id: int, handles: list[Any]) -> None:
        """Roll back these undecided gids, as the holder of the current epoch (without an epoch,
        in a plain writeStream whose commit process has not opened yet: the stored one)."""
        if self.mode == "idempotent":
            return  # committed partitions stay; the replay skips them through their markers
        gids = {h["gid"] for h in handles if h}
        if not gids:
            return

        def run(conn: psycopg.Connection) -> int:
            prepared = [p for p in self._prepared(conn, f"{self._prefix(lineage)}{batch_id}:") if p.gid in gids]
            mine = self.epoch if self.epoch is not None else fence.stored_epoch(conn, self.epoch_table, self.sink_id, lineage)
            return self._rollback_undecided(conn, lineage, prepared, mine, "abort")

        self._retrying("abort", run, lineage)
