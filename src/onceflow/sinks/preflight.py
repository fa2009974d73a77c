"""Read-only checks of a sink for ``onceflow run --dry-run``: options, target, permissions.

:func:`preflight` does what a sink's ``validate`` does before a query starts, minus every
write: no table, directory or topic is created, no epoch taken, no probe record produced.
What a check could only learn by writing is said, not done (e.g. Kafka's aborted-record
probe: ``onceflow doctor --kafka`` runs it). Returns the lines to print; raises ConfigError
(wrong configuration, missing permission) or SinkError (unreachable) like ``validate``.
"""

from __future__ import annotations

import os
from typing import Any

from pyspark.sql.types import StructType

from onceflow.errors import ConfigError, SinkError
from onceflow.sinks.base import TwoPhaseCommitSink


def _writable_ancestor(path: str) -> str | None:
    """The nearest existing ancestor of local ``path`` if this process may create in it."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return p if os.path.isdir(p) and os.access(p, os.W_OK | os.X_OK) else None


def _delta(src: Any, schema: StructType, overwrite: bool) -> list[str]:
    src.validate(schema, overwrite, create=False)  # its own checks, without creating the table
    table = src._table()
    if table is not None:
        return [f"Delta table {src.table_url}: version {table.version()}, the stream's columns fit"]
    if "://" not in src.table_url or src.table_url.startswith("file:"):
        local = src.table_url.split("://", 1)[-1]
        if _writable_ancestor(local) is None:
            raise ConfigError(f"onceflow-delta: cannot create {src.table_url}: its nearest existing "
                              "directory is not writable")
    return [f"Delta table {src.table_url}: absent, created by the first batch"]


def _postgres(src: Any, schema: StructType, overwrite: bool) -> list[str]:
    import psycopg

    from onceflow.sinks.postgres.doctor import doctor

    if overwrite:
        raise ConfigError("onceflow-postgres: output mode 'complete' is not supported; use write=upsert with keys")
    checks = doctor(src.opts["dsn"], src.log_schema)
    if not checks[0].ok:
        raise SinkError(f"onceflow-postgres: {checks[0].detail}")
    wanted = {"reachable", "server_version", "create_privilege"}
    if src.mode == "two_phase":
        wanted.add("max_prepared_transactions")
    failed = [c for c in checks if c.name in wanted and not c.ok]
    if failed:
        raise ConfigError(f"onceflow-postgres: {failed[0].name}: {failed[0].detail}")
    lines = [f"PostgreSQL {c.name}: {c.detail}" for c in checks if c.name in wanted]
    try:
        with src._connect("dry-run") as conn:
            if src._table_columns(conn) is None:
                if not src.create_table:
                    raise ConfigError(f"onceflow-postgres: table {src.opts['table']} does not exist in "
                                      f"{src.where}; create it, or set create_table=True")
                lines.append(f"table {src.opts['table']}: absent, created from the stream's schema")
            else:
                src._check_table(conn, schema)  # read-only for an existing table
                lines.append(f"table {src.opts['table']}: the stream's columns fit")
    except psycopg.errors.InsufficientPrivilege as e:
        raise src._refused(e) from None
    except psycopg.OperationalError as e:
        raise SinkError(f"onceflow-postgres: PostgreSQL at {src.where} unreachable ({src._safe(e)})") from None
    return lines


def _kafka(src: Any, schema: StructType, overwrite: bool) -> list[str]:
    from onceflow.sinks.kafka.common import reachable
    from onceflow.sinks.kafka.probe import marker_topic_check, transaction_timeout_check

    md = reachable(src.conf, min(src.timeout, 15))
    fields = {f.name for f in schema.fields}
    if src.value_column not in fields:
        raise ConfigError(f"onceflow-kafka-sink: the stream has no {src.value_column!r} column "
                          f"(columns: {', '.join(sorted(fields))})")
    if src.topic is not None:
        t = md.topics.get(src.topic)
        if t is None or t.error is not None:
            raise ConfigError(f"onceflow-kafka-sink: topic {src.topic} does not exist on {src.bootstrap}")
    lines = [f"Kafka {src.bootstrap}: {len(md.brokers)} broker(s)"
             + (f", topic {src.topic}: {len(md.topics[src.topic].partitions)} partition(s)" if src.topic else "")]
    if src.mode == "exactly_once":
        for check in (transaction_timeout_check(src.conf, src.transaction_timeout, min(src.timeout, 15)),
                      marker_topic_check(src.conf, md, src.marker_topic, min(src.timeout, 15))):
            if not check.ok:
                raise ConfigError(f"onceflow-kafka-sink: {check.name}: {check.detail}")
            lines.append(f"{check.name}: {check.detail}")
        lines.append("aborted-record probe: not run (it writes); 'onceflow doctor --kafka "
                     f"{src.bootstrap}' runs it")
    return lines


def _iceberg(src: Any, schema: StructType, overwrite: bool) -> list[str]:
    table = src._table()
    if table is None:
        if overwrite:
            raise ConfigError("onceflow-iceberg: the Iceberg sink supports append only so far")
        return [f"Iceberg table {src.identifier}: absent, created from the stream's schema"]
    src.validate(schema, overwrite)  # read-only for an existing table
    return [f"Iceberg table {src.identifier}: the stream's columns fit"]


_CHECKS = {"onceflow-delta": _delta, "onceflow-postgres": _postgres, "onceflow-kafka-sink": _kafka,
           "onceflow-iceberg": _iceberg}


def preflight(source: TwoPhaseCommitSink, schema: StructType, overwrite: bool) -> list[str]:
    """Read-only checks of ``source`` for a stream of ``schema`` (see module doc)."""
    check = _CHECKS.get(source.format_name)
    if check is None:
        return [f"{source.format_name}: options valid; no read-only check of its target"]
    return check(source, schema, overwrite)
