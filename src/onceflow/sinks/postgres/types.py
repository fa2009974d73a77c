"""Types and tables of the PostgreSQL sink: Spark column types against the target table.

Guarantees: :func:`pg_type` maps every supported Spark type to the PostgreSQL type a created
table gets and refuses the others (nested types) with a ConfigError naming the type;
:func:`type_ok` accepts a table column only when it holds every value of the stream's type
without loss (equal or wider types; ``numeric(P,S)`` with no fewer integer digits and no
smaller scale). Text into ``varchar(n)`` is accepted: the stream has no lengths, and a too long
value fails its task with a clear error instead. :meth:`Tables._check_table` checks (or, with
``create_table``, creates) the target table before the query starts and names every mismatched
column in one ConfigError; upsert needs a primary key or unique index on exactly the keys.
"""

from __future__ import annotations

import logging
import re

import psycopg
from psycopg import sql
from pyspark.sql import types as T

from onceflow.errors import ConfigError
from onceflow.sinks.postgres.dsn import FORMAT

log = logging.getLogger(__name__)

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


def type_ok(want: str, have: str) -> bool:
    """Can values of PostgreSQL type ``want`` (from the stream) be stored in column type ``have``
    without loss? Text into ``varchar(n)`` is allowed (a too-long value fails its task clearly)."""
    base = re.sub(r"\(.*\)", "", have).strip()
    want_base = re.sub(r"\(.*\)", "", want).strip()
    if base == "numeric" and (want_base == "numeric" or want_base in _INT_DIGITS):
        return _numeric_fits(want, have)
    return want == have or base == want_base or base in _ALSO.get(want_base, set())


class Tables:
    """Target-table checks of :class:`~onceflow.sinks.postgres.source.PostgresDataSource`."""

    opts: dict[str, str]
    keys: list[str]
    create_table: bool
    write_kind: str
    where: str
    table: sql.Identifier

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
            for n in want if n in have and not type_ok(want[n], have[n][0])
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
