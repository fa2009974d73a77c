"""Upsert staging of the PostgreSQL sink: tasks stage rows, the driver merges a decided batch.

In ``write=upsert`` tasks never touch the target table: they COPY their rows, tagged
(lineage, batch, partition, position in the partition), into ``<log_schema>.onceflow_stage_<hash
of sink_id and table>`` inside their prepared or local transaction.

Guarantees: :meth:`Staging._merge` moves one decided batch's staged rows into the table in ONE
statement (``DELETE ... RETURNING`` from staging feeding ``INSERT ... ON CONFLICT (keys) DO
UPDATE``), keeping per key the **last row in (partition, position) order**, whatever the
partitions' timing; it is idempotent (a second run finds nothing staged), so a batch becomes
visible atomically and exactly once, and recovery may repeat it for every decided batch still
staged. The staging table repeats the table's NOT NULL constraints and its CHECK constraints
over the stream's columns, so a row violating them fails its task before the batch is decided;
it is recreated for new columns or constraints only while nothing is staged or prepared, and
its DDL waits at most 10 s for locks. Its comment (sink_id, table, keys, constraints) lets
recovery and ``onceflow doctor --resolve`` merge without the job's options.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import psycopg
from psycopg import sql
from pyspark.sql import types as T

from onceflow.errors import ConfigError, SinkError
from onceflow.sinks.postgres.copy import STAGE_COLUMNS
from onceflow.sinks.postgres.dsn import FORMAT
from onceflow.sinks.postgres.fence import advisory_key

log = logging.getLogger(__name__)


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


def column_types(conn: psycopg.Connection, table: sql.Identifier) -> dict[str, str] | None:
    """column -> formatted type of an existing table; None when it does not exist."""
    oid = conn.execute("SELECT to_regclass(%s)::oid", [table.as_string(conn)]).fetchone()[0]
    if oid is None:
        return None
    return dict(conn.execute(
        "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
        "WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped ORDER BY attnum", [oid],
    ).fetchall())


class Staging:
    """Upsert staging of :class:`~onceflow.sinks.postgres.source.PostgresDataSource`."""

    sink_id: str
    opts: dict[str, str]
    keys: list[str]
    log_schema: str
    table: sql.Identifier
    stage_table: sql.Identifier

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
        target = column_types(conn, self.table) or {}
        want = STAGE_COLUMNS | {n: target[n] for n in schema.names}
        meta = {"sink_id": self.sink_id, "table": self.opts["table"], "keys": self.keys,
                **self._stage_constraints(conn, schema.names)}
        name = self.stage_table.as_string(conn)
        try:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", [advisory_key("onceflow-ddl")])
                conn.execute("SET LOCAL lock_timeout = '10s'")
                have = column_types(conn, self.stage_table)
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
        cols = [n for n in column_types(conn, st) or {} if n not in STAGE_COLUMNS]
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
