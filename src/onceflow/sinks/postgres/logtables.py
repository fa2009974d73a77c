"""onceflow's own tables in the sink's ``log_schema``, created (and upgraded) on first use.

* ``onceflow_commit_log``: one decision per (sink, lineage, batch): fingerprint, handles, epoch.
* ``onceflow_markers``: ``idempotent`` mode, one row per committed (sink, lineage, batch,
  partition) with its row count, batch fingerprint and content digest.
* ``onceflow_epochs``: the fencing epoch per (sink, lineage) (:mod:`.fence`).

Columns added by later onceflow versions are added to older tables, under an advisory lock and
only when missing (ALTER TABLE takes an exclusive lock even when it changes nothing).
"""

from __future__ import annotations

import psycopg
from psycopg import sql

from onceflow.sinks.postgres import fence

COMMIT_LOG = "onceflow_commit_log"
MARKERS = "onceflow_markers"


def _add_missing(conn: psycopg.Connection, table: sql.Identifier, columns: dict[str, str]) -> None:
    have = {r[0] for r in conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped",
        [table.as_string(conn)]).fetchall()}
    missing = [sql.SQL("ADD COLUMN IF NOT EXISTS {} ").format(sql.Identifier(c)) + sql.SQL(t)
               for c, t in columns.items() if c not in have]
    if missing:
        conn.execute(sql.SQL("ALTER TABLE {} ").format(table) + sql.SQL(", ").join(missing))


def ensure(conn: psycopg.Connection, schema: str) -> None:
    """Create or upgrade the three tables of ``schema`` (idempotent, concurrent-safe)."""
    log_table, markers = sql.Identifier(schema, COMMIT_LOG), sql.Identifier(schema, MARKERS)
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", [fence.advisory_key("onceflow-ddl")])
        conn.execute(sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (sink text NOT NULL, lineage text NOT NULL, "
            "batch_id bigint NOT NULL, fingerprint text NOT NULL, handles jsonb NOT NULL, "
            "committed_at timestamptz NOT NULL DEFAULT now(), epoch bigint, PRIMARY KEY (sink, lineage, batch_id))"
        ).format(log_table))
        _add_missing(conn, log_table, {"epoch": "bigint"})
        conn.execute(sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (sink text NOT NULL, lineage text NOT NULL, "
            "batch_id bigint NOT NULL, partition integer NOT NULL, rows bigint NOT NULL DEFAULT 0, "
            "written_at timestamptz NOT NULL DEFAULT now(), fingerprint text, digest text, "
            "PRIMARY KEY (sink, lineage, batch_id, partition))"
        ).format(markers))
        _add_missing(conn, markers, {"fingerprint": "text", "digest": "text"})
        fence.create_table(conn, sql.Identifier(schema, fence.EPOCH_TABLE))
