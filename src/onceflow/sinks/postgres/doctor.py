"""``onceflow doctor --postgres DSN [--resolve]``: checks and recovery for the PostgreSQL sink.

Guarantees: :func:`doctor` only reads (reachability, version, slots, privileges, dangling
prepared transactions, staged upsert rows) and never raises for an unreachable server (the
first check says so). :func:`resolve` applies the recovery rules of docs/protocol.md to every
lineage with a dangling onceflow prepared transaction or staged upsert rows: it opens the sink
for the lineage (a new epoch, so a driver that was stopped can never decide afterwards) and
recovers: commit what a decision in ``onceflow_commit_log`` lists, roll back the rest, merge
decided upsert batches. It never fences a running job: for a lineage with a connected session
(:func:`~onceflow.sinks.postgres.fence.backends`: a running or paused driver, or idle Spark
workers of a stopped query) it takes no epoch, only rolls forward and rolls back what
superseded epochs left, and reports the current epoch's undecided transactions as skipped.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from onceflow.errors import FencedError, OnceflowError
from onceflow.sinks.checks import CheckResult
from onceflow.sinks.postgres.dsn import split_dsn, where
from onceflow.sinks.postgres.fence import backends
from onceflow.sinks.postgres.source import GID, PostgresDataSource
from onceflow.sinks.postgres.stage import stage_tables
from onceflow.sinks.postgres.task import SLOT_RULE


@dataclass
class ResolveReport:
    """What :func:`resolve` did."""

    committed: int = 0
    rolled_back: int = 0
    merged: int = 0  # upsert batches moved from staging into their table
    skipped: list[str] = field(default_factory=list)  # "sink/lineage: reason"

    @property
    def ok(self) -> bool:
        return not self.skipped


def _source(dsn: str, sink_id: str = "postgres", log_schema: str = "public") -> PostgresDataSource:
    return PostgresDataSource({"dsn": dsn, "table": "unused", "sink_id": sink_id, "log_schema": log_schema})


def _dangling(conn: psycopg.Connection, log_schema: str) -> dict[tuple[str, str], list[tuple[str, int, bool, float]]]:
    """(sink, lineage) -> [(gid, batch, decided, age seconds)] of onceflow prepared transactions."""
    rows = conn.execute(
        "SELECT gid, extract(epoch FROM now() - prepared) FROM pg_prepared_xacts "
        "WHERE database = current_database() AND starts_with(gid, 'onceflow:') ORDER BY prepared"
    ).fetchall()
    has_log = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL",
        [sql.Identifier(log_schema, "onceflow_commit_log").as_string(conn)],
    ).fetchone()[0]
    out: dict[tuple[str, str], list[tuple[str, int, bool, float]]] = defaultdict(list)
    for gid, age in rows:
        m = GID.match(gid)
        if not m:
            continue
        decided = False
        if has_log:
            decided = conn.execute(
                sql.SQL("SELECT handles @> %s::jsonb FROM {} WHERE sink = %s AND lineage = %s AND batch_id = %s")
                .format(sql.Identifier(log_schema, "onceflow_commit_log")),
                [json.dumps([{"gid": gid}]), m["sink"], m["lineage"], int(m["batch"])],
            ).fetchone() or (False,)
            decided = bool(decided[0])
        out[(m["sink"], m["lineage"])].append((gid, int(m["batch"]), decided, float(age)))
    return out


def _staged(conn: psycopg.Connection, log_schema: str) -> dict[tuple[str, str], int]:
    """(sink, lineage) -> staged upsert rows not yet merged (decided or not), per staging table comment."""
    out: dict[tuple[str, str], int] = defaultdict(int)
    for table, meta in stage_tables(conn, log_schema):
        for lineage, n in conn.execute(sql.SQL("SELECT _onceflow_lineage, count(*) FROM {} GROUP BY 1").format(table)):
            out[(meta["sink_id"], lineage)] += n
    return out


def doctor(dsn: str, log_schema: str = "public") -> list[CheckResult]:
    """Reachability, server version, max_prepared_transactions, CREATE privilege, dangling transactions."""
    source = _source(dsn, log_schema=log_schema)
    try:
        conn = source._connect("doctor")
    except psycopg.OperationalError as e:
        return [CheckResult("reachable", False, str(source._connect_error(e)))]
    results = []
    with conn:
        user = conn.execute("SELECT current_user").fetchone()[0]
        results.append(CheckResult("reachable", True, f"{where(dsn)} as {user}"))
        version, num = conn.execute("SELECT current_setting('server_version'), current_setting('server_version_num')::int").fetchone()
        results.append(CheckResult(
            "server_version", num >= 100000,
            f"PostgreSQL {version}" + ("" if num >= 100000 else " (onceflow needs 10 or newer)"),
        ))
        mpt = int(conn.execute("SHOW max_prepared_transactions").fetchone()[0])
        in_use = conn.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone()[0]
        results.append(CheckResult(
            "max_prepared_transactions", mpt > 0,
            f"{mpt} ({in_use} in use now): mode two_phase available; {SLOT_RULE}" if mpt > 0 else
            "0: mode two_phase unavailable; set max_prepared_transactions (e.g. 64, restart needed) "
            "or use mode='idempotent'",
        ))
        can_create = conn.execute(
            "SELECT rolsuper OR has_schema_privilege(current_user, %s, 'CREATE') FROM pg_roles WHERE rolname = current_user",
            [log_schema],
        ).fetchone()[0]
        results.append(CheckResult(
            "create_privilege", bool(can_create),
            f"{user} can create tables in schema {log_schema}" if can_create else
            f"{user} cannot create tables in schema {log_schema}: grant CREATE, or create "
            "onceflow_commit_log / onceflow_markers / onceflow_epochs and the target table beforehand",
        ))
        dangling = _dangling(conn, log_schema)
        n = sum(len(v) for v in dangling.values())
        if not n:
            results.append(CheckResult("dangling_prepared_transactions", True, "none"))
        else:
            parts = []
            for (sink, lineage), items in dangling.items():
                decided = sum(1 for i in items if i[2])
                parts.append(
                    f"sink {sink} lineage {lineage}: {decided} decided (to commit), "
                    f"{len(items) - decided} undecided (to roll back), oldest {max(i[3] for i in items):.0f}s"
                )
            results.append(CheckResult(
                "dangling_prepared_transactions", False,
                f"{n} onceflow prepared transaction(s): {'; '.join(parts)}. They hold locks until resolved; "
                "restart the job (it recovers them) or run 'onceflow doctor --postgres DSN --resolve'",
            ))
        staged = _staged(conn, log_schema)
        results.append(CheckResult(
            "staged_upsert_rows", True,
            "none" if not staged else "; ".join(
                f"sink {s} lineage {lineage}: {n} row(s) of batches in flight, not yet decided, or decided "
                "and waiting for their merge (the job's restart or --resolve merges decided ones)"
                for (s, lineage), n in staged.items()),
        ))
    results.append(CheckResult("guarantees", True, ". ".join(guarantees())))
    return results


def guarantees() -> list[str]:
    """The guarantee of every mode and write kind (two_phase, idempotent append, idempotent upsert)."""
    kinds = ({}, {"mode": "idempotent"}, {"mode": "idempotent", "write": "upsert", "keys": "k"})
    return [PostgresDataSource({"dsn": "host=unused", "table": "unused", **k}).describe_guarantee() for k in kinds]


def resolve(dsn: str, log_schema: str = "public") -> ResolveReport:
    """Commit decided and roll back undecided onceflow prepared transactions, then merge decided
    upsert batches still staged. The current epoch's undecided transactions of a lineage with a
    connected session are left alone and reported in ``skipped`` (stop that job first)."""
    report = ResolveReport()
    source = _source(dsn, log_schema=log_schema)
    try:
        conn = source._connect("doctor")
    except psycopg.OperationalError as e:
        raise source._connect_error(e) from None
    with conn:
        groups = list(dict.fromkeys([*_dangling(conn, log_schema), *_staged(conn, log_schema)]))
        for sink, lineage in groups:
            source = _source(dsn, sink, log_schema)
            live = backends(conn, sink, lineage)
            try:
                if live:  # roll forward, and roll back only what superseded epochs left
                    source.recover(lineage)
                else:  # nobody there: a new epoch, then full recovery
                    source.open(lineage)
            except FencedError:
                report.skipped.append(f"{sink}/{lineage}: a driver opened it while resolving; it recovers the lineage itself")
                continue
            except OnceflowError as e:
                report.skipped.append(f"{sink}/{lineage}: {e}")
                continue
            finally:
                source.close()
            report.committed += source.recovered.get("committed", 0)
            report.rolled_back += source.recovered.get("rolled_back", 0)
            report.merged += source.recovered.get("merged", 0)
            left = len(source._prepared(conn, source._prefix(lineage)))
            if live and left:
                pid, name, state = live[0]
                report.skipped.append(
                    f"{sink}/{lineage}: {left} undecided prepared transaction(s) of the current epoch left to its "
                    f"driver, which is connected ({len(live)} session(s), e.g. backend pid {pid} '{name}', {state}; "
                    "idle Spark workers of a stopped query count too); stop it, then resolve again")
    return report


__all__ = ["CheckResult", "ResolveReport", "doctor", "resolve", "split_dsn"]
