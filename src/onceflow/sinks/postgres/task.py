"""Task side of the PostgreSQL sink: a task's pre-commit (docs/protocol.md, step 2).

Guarantees (the driver side is :mod:`.source`):

* A task of an older epoch raises FencedError before writing. Before writing, a two_phase
  task rolls back undecided prepared transactions of this lineage of older epochs and other
  attempts of its own partition in its epoch (:meth:`TaskWriter._clean_stale`): their drivers
  are fenced or their attempts dead, and their row locks would block it.
* two_phase: COPY + ``PREPARE TRANSACTION`` under a gid carrying the epoch; a task that finds a
  newer epoch (or a decision) after its PREPARE rolls its gid back itself. Crash window: a
  task that dies between its PREPARE and that check leaves an undecided gid, which the next
  task of a newer epoch (or of this partition) and recovery roll back.
* idempotent: rows and a (lineage, batch, partition) marker in one local transaction,
  committed only while the task's epoch is current (``FOR SHARE``); a replay skips a committed
  partition only when fingerprint and content digest match.
* Every lock wait of a task's transaction is bounded by ``lock_timeout`` (default 10 s): a
  task blocked by rows a dead task or zombie driver prepared under the same keys fails with a
  SinkError naming the prepared transactions that hold locks on the table, and its retry
  (Spark's task retry, or the restarted query) rolls them back as above. Without the bound it
  waited forever: the zombie's gid blocks the very clean-up that would remove it.
* A connection lost while writing is a SinkError (the task is retried or the batch replayed).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import sql
from pyspark.sql import types as T

from onceflow.errors import SinkError
from onceflow.sinks.base import TaskInfo, fenced
from onceflow.sinks.postgres import fence
from onceflow.sinks.postgres.copy import _copy
from onceflow.sinks.postgres.dsn import FORMAT
from onceflow.sinks.postgres.stage import column_types
from onceflow.sinks.replay import ContentDigest, check_replay, task_fingerprint

log = logging.getLogger("onceflow.sinks.postgres.source")  # one logger for the sink's lines

#: The one sizing rule for ``max_prepared_transactions`` (PREPARE error, doctor, docs).
SLOT_RULE = (
    "every write task of a two_phase batch holds one prepared transaction from its PREPARE until the "
    "batch commits, so max_prepared_transactions must be at least the write partitions of all two_phase "
    "onceflow queries running against the server, plus the prepared transactions anything else holds "
    "there, plus headroom for speculative task attempts"
)
#: seconds a task's transaction waits for a row or table lock (``lock_timeout`` option)
DEFAULT_LOCK_TIMEOUT = 10.0


class TaskWriter:
    """The task side of :class:`~onceflow.sinks.postgres.source.PostgresDataSource` (a mixin:
    the fence, session and prepared-transaction helpers it calls are the data source's)."""

    opts: dict[str, str]
    sink_id: str
    mode: str
    write_kind: str
    where: str
    epoch: int | None
    lock_timeout: float
    table: sql.Identifier
    stage_table: sql.Identifier
    log_table: sql.Identifier
    marker_table: sql.Identifier
    epoch_table: sql.Identifier

    def is_decided(self, lineage: str, batch_id: int) -> bool:
        return self._retrying("decision lookup", lambda conn: self._is_decided(conn, lineage, batch_id), lineage, "task")

    def _is_decided(self, conn: psycopg.Connection, lineage: str, batch_id: int) -> bool:
        q = sql.SQL("SELECT 1 FROM {} WHERE sink = %s AND lineage = %s AND batch_id = %s").format(self.log_table)
        return conn.execute(q, [self.sink_id, lineage, batch_id]).fetchone() is not None

    def _marked(self, conn: psycopg.Connection, lineage: str, batch_id: int) -> dict[int, int | None]:
        """Partition -> rows of every committed marker of (lineage, batch), an undecided batch
        (a decision deletes them): append rows are visible, upsert rows staged."""
        return dict(conn.execute(sql.SQL(
            "SELECT partition, rows FROM {} WHERE sink = %s AND lineage = %s AND batch_id = %s ORDER BY 1"
        ).format(self.marker_table), [self.sink_id, lineage, batch_id]).fetchall())

    def visible_partitions(self, lineage: str, batch_id: int) -> dict[int, int | None]:
        """idempotent append: the partitions of undecided batch N whose task transactions
        committed (their rows are in the table). upsert stages rows (invisible until the merge)
        and two_phase prepares them: none. A read; it takes no lock."""
        if self.mode != "idempotent" or self.write_kind == "upsert":
            return {}

        def run(conn: psycopg.Connection) -> dict[int, int | None]:
            try:
                return self._marked(conn, lineage, batch_id)
            except psycopg.errors.UndefinedTable:  # no marker table yet: nothing was written here
                return {}

        return self._retrying("marker lookup", run, lineage)

    def _task_epoch(self, conn: psycopg.Connection, lineage: str) -> int:
        """The task's epoch: the ``epoch`` option, which must not be older than the stored one
        (else FencedError); without it (plain writeStream) the stored epoch."""
        current = fence.stored_epoch(conn, self.epoch_table, self.sink_id, lineage)
        mine = self.epoch
        if mine is None:
            return current
        if mine < current:
            raise fenced(FORMAT, lineage, mine, current, "write")
        return mine

    def _write_rows(self, cur: psycopg.Cursor, task: TaskInfo, schema: T.StructType, batches: Iterator) -> int:
        """COPY the partition into the table (append) or the staging table (upsert)."""
        target, stage = (self.table, None) if self.write_kind == "append" else (
            self.stage_table, (task.lineage, task.batch_id, task.partition))
        types = column_types(cur.connection, target)
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
        """Check the epoch (FencedError when older than the stored one) and clean up stale
        transactions, then write: two_phase COPY + PREPARE under a gid carrying the epoch;
        idempotent rows + marker (:meth:`_pre_commit_idempotent`)."""
        run, lineage = _run_id(), task.lineage

        def start(conn: psycopg.Connection) -> int:  # also proves the session alive before any row is consumed
            epoch = self._task_epoch(conn, lineage)
            if self.mode == "two_phase":
                self._clean_stale(conn, task, run, epoch)
            return epoch

        epoch = self._retrying("task", start, lineage, "task")
        try:
            return self._pre_commit(task, schema, batches, run, epoch)
        except psycopg.errors.LockNotAvailable:  # before OperationalError, its base class
            raise self._lock_wait_error(task) from None
        except psycopg.OperationalError as e:  # connection lost while writing: the task is retried
            raise SinkError(f"{FORMAT}: task of batch {task.batch_id} failed: PostgreSQL at {self.where} "
                            f"unreachable ({self._safe(e)}); the task is retried or the batch replayed") from None

    def _set_lock_timeout(self, cur: psycopg.Cursor) -> None:
        """Bound every lock wait of the task's transaction (it ends with the transaction)."""
        cur.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(f"{round(self.lock_timeout * 1000)}ms")))

    def _lock_wait_error(self, task: TaskInfo) -> SinkError:
        """A task's transaction waited ``lock_timeout`` for a lock: name what holds locks on its
        table, and say that the retry rolls back what a dead attempt or older driver prepared."""
        target = self.table if self.write_kind == "append" else self.stage_table

        def holders(conn: psycopg.Connection) -> list[str]:
            return [g for (g,) in conn.execute(
                # a prepared transaction's locks have no pid and share the virtual transaction
                # of its transaction id's lock
                "SELECT p.gid FROM pg_prepared_xacts p WHERE p.database = current_database() AND EXISTS "
                "(SELECT 1 FROM pg_locks x JOIN pg_locks l ON l.virtualtransaction = x.virtualtransaction "
                "WHERE x.locktype = 'transactionid' AND x.transactionid = p.transaction AND x.pid IS NULL "
                "AND l.pid IS NULL AND l.relation = to_regclass(%s)) ORDER BY 1",
                [target.as_string(conn)]).fetchall()]

        try:
            found = self._retrying("lock holders lookup", holders, task.lineage, "task")
        except (SinkError, psycopg.Error):
            found = []
        held = (f"prepared transaction(s) {', '.join(found)} hold locks on it" if found
                else "see pg_locks / pg_stat_activity for the holder")
        return SinkError(
            f"{FORMAT}: task of batch {task.batch_id} partition {task.partition} (attempt {task.attempt}) "
            f"waited {self.lock_timeout:g}s for a lock on {target.as_string(None)} and gave up ({held}); "
            "the task is retried, and the retry rolls back undecided prepared transactions of older "
            "epochs and of this partition's other attempts (a dead task or zombie driver). If it keeps "
            "failing, rows of one batch repeat a unique key across partitions (deduplicate them in the "
            "transform, or use write=upsert) or another session holds the rows (end it)"
        )

    def _pre_commit(self, task: TaskInfo, schema: T.StructType, batches: Iterator, run: str, epoch: int) -> tuple[Any, int]:
        lineage = task.lineage
        with self._session("task", lineage) as conn:
            if self.mode == "idempotent":
                return self._pre_commit_idempotent(conn, task, schema, batches, epoch)
            gid = f"onceflow:{self.sink_id}:{lineage}:{task.batch_id}:{task.partition}:{task.attempt}:e{epoch}:{run}"
            with conn.cursor() as cur:
                cur.execute("BEGIN")
                self._set_lock_timeout(cur)
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
            # A successor took a newer epoch while this task wrote (its driver is a zombie; the
            # successor's recovery may have run before this PREPARE and cannot have seen it): no
            # decision will ever list this gid, so do not leave it dangling.
            current = fence.stored_epoch(conn, self.epoch_table, self.sink_id, lineage)
            if self.epoch is not None and current > epoch:
                self._finish(conn, "ROLLBACK", gid)
                raise fenced(FORMAT, lineage, epoch, current, "write")
            # A decision recorded meanwhile cannot list this gid: do not leave it dangling.
            if self._is_decided(conn, lineage, task.batch_id):
                self._finish(conn, "ROLLBACK", gid)
                return None, 0
            return {"gid": gid, "xid": xid}, rows

    def _clean_stale(self, conn: psycopg.Connection, task: TaskInfo, run: str, epoch: int) -> None:
        """Roll back undecided gids of this lineage of older epochs (their drivers are fenced)
        and other attempts of this very partition in this epoch: they are dead, and their row
        locks would block an upsert. Gids of a newer epoch are never touched."""
        stale = [
            p for p in self._prepared(conn, self._prefix(task.lineage))
            if p.older_than(epoch)
            or (p.epoch == epoch and p.batch == task.batch_id and p.partition == task.partition
                and (p.attempt, p.run) != (task.attempt, run))
        ]
        if stale:
            n = self._rollback_undecided(conn, task.lineage, stale, epoch, "clean-up of stale transactions")
            log.info("%s: rolled back %d stale prepared transaction(s) of %s", FORMAT, n, task.lineage)

    def _pre_commit_idempotent(self, conn: psycopg.Connection, task: TaskInfo, schema: T.StructType,
                               batches: Iterator, epoch: int) -> tuple[Any, int]:
        """Rows and marker in one local transaction, committed only while ``epoch`` is current.

        The marker keeps the batch fingerprint and the partition's content digest; a replay
        skips a committed partition only when both match (:mod:`onceflow.sinks.replay`)."""
        fingerprint = task_fingerprint(self.opts.get("checkpointlocation"), task.batch_id)
        digest = ContentDigest()
        with conn.transaction(), conn.cursor() as cur:
            self._set_lock_timeout(cur)
            cur.execute("SELECT pg_advisory_xact_lock_shared(%s)", [fence.advisory_key("onceflow-decide", self.sink_id, task.lineage)])
            if self._is_decided(conn, task.lineage, task.batch_id):
                for _ in batches:  # upstream state commits only when the input is consumed
                    pass
                return None, 0
            ident = [self.sink_id, task.lineage, task.batch_id, task.partition]
            fresh = cur.execute(sql.SQL(
                "INSERT INTO {} (sink, lineage, batch_id, partition) VALUES (%s, %s, %s, %s) "
                "ON CONFLICT DO NOTHING RETURNING 1").format(self.marker_table), ident).fetchone()
            if fresh is None:  # an earlier attempt committed this partition
                done, stored_fp, stored_digest = cur.execute(sql.SQL(
                    "SELECT rows, fingerprint, digest FROM {} "
                    "WHERE sink = %s AND lineage = %s AND batch_id = %s AND partition = %s"
                ).format(self.marker_table), ident).fetchone()
                for _ in digest.feed(batches):
                    pass
                check_replay(f"{FORMAT} sink {self.sink_id}", task.batch_id, task.partition, task.lineage,
                             stored_fingerprint=stored_fp, fingerprint=fingerprint,
                             stored_digest=stored_digest, digest=digest.hexdigest(),
                             committed=self._marked(conn, task.lineage, task.batch_id),
                             staged=self.write_kind == "upsert")
                return {"partition": task.partition, "rows": done}, done
            rows = self._write_rows(cur, task, schema, digest.feed(batches))
            cur.execute(sql.SQL(
                "UPDATE {} SET rows = %s, fingerprint = %s, digest = %s "
                "WHERE sink = %s AND lineage = %s AND batch_id = %s AND partition = %s"
            ).format(self.marker_table), [rows, fingerprint, digest.hexdigest(), *ident])
            # Committing this transaction makes the rows visible: only while our epoch is current.
            self._check(conn, task.lineage, epoch, "write", lock=True)
        return {"partition": task.partition, "rows": rows}, rows


def _run_id() -> str:
    """Spark's run id of the streaming query (its job group), or 'unknown' (also outside Spark)."""
    try:
        from pyspark import TaskContext

        tc = TaskContext.get()
    except Exception:  # noqa: BLE001 - no Spark task here
        tc = None
    value = tc.getLocalProperty("spark.jobGroup.id") if tc else None
    return (value or "unknown").lower()
