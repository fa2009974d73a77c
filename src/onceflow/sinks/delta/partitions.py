"""Partitioned Delta tables: partition values as the Delta protocol serializes them, Hive-style
directory names, and the split of a batch into one part per partition value.

Layout: every write attempt still writes one *unit* (:mod:`.files`), now a directory whose
files sit in Hive-style subdirectories, ``<unit>/<col>=<value>/.../<file>.parquet``: the JVM
path's per-batch directory (Spark's ``partitionBy`` writes them), and on the Arrow path one
directory per task. Clean-up and recovery still delete whole units, so partitioning adds no
crash window. The data files do not hold the partition columns (as Spark and delta-rs write
them); each add action carries them as ``partitionValues``.

Values (Delta protocol, "Partition Value Serialization"): strings as they are, integers in
decimal, booleans ``true``/``false``, dates ``YYYY-MM-DD``, timestamps ``YYYY-MM-DD
HH:MM:SS.ffffff`` in UTC, decimals in plain notation. A null partition value is JSON ``null``
in the log and the directory ``__HIVE_DEFAULT_PARTITION__``; as in the protocol (and Spark), an
empty string is a null partition value. Floating-point, binary and nested columns are refused
as partition columns (ConfigError).
"""

from __future__ import annotations

import datetime as dt
import decimal
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc

from onceflow.errors import ConfigError

#: the directory of a null partition value (Hive, Spark, delta-rs)
NULL_DIR = "__HIVE_DEFAULT_PARTITION__"
#: characters Hive and Spark escape as %XX in partition directory names
_ESCAPE = frozenset([chr(c) for c in range(0x01, 0x20)] + list('"#%\'*/:=?\\\x7f{[]^'))


def check_columns(schema: pa.Schema, partition_by: Sequence[str], where: str) -> None:
    """Partition columns must be columns of the stream, of a type Delta can partition by."""
    names = schema.names
    missing = [c for c in partition_by if c not in names]
    if missing:
        raise ConfigError(f"{where}: partition column(s) {', '.join(missing)} are not columns of the "
                          f"stream ({', '.join(names)}); select them in the transform or fix partition_by")
    if len(set(partition_by)) != len(partition_by):
        raise ConfigError(f"{where}: partition_by={list(partition_by)} names a column twice")
    if len(partition_by) and len(partition_by) == len(names):
        raise ConfigError(f"{where}: partition_by={list(partition_by)} leaves no data column; "
                          "keep at least one column out of partition_by")
    for c in partition_by:
        t = schema.field(c).type
        if not (pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)
                or pa.types.is_boolean(t) or pa.types.is_date32(t) or pa.types.is_timestamp(t)
                or pa.types.is_decimal(t)):
            raise ConfigError(f"{where}: partition column {c} has type {t}; partition by a string, "
                              "integer, boolean, date, timestamp or decimal column (cast it in the transform)")


def serialize(value: Any) -> str | None:
    """A Python value of a partition column as the Delta log's ``partitionValues`` string."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dt.datetime):
        if value.tzinfo is not None:
            value = value.astimezone(dt.UTC).replace(tzinfo=None)
        return value.strftime("%Y-%m-%d %H:%M:%S.%f")
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return format(value, "f")
    text = str(value)
    return text or None  # the protocol: an empty string is a null partition value


def escape(text: str) -> str:
    """Hive's escaping of a partition directory name component."""
    return "".join(f"%{ord(ch):02X}" if ch in _ESCAPE else ch for ch in text)


def directory(partition_by: Sequence[str], values: dict[str, str | None]) -> str:
    """``col=value/...`` for serialized ``values`` (null: :data:`NULL_DIR`)."""
    return "/".join(f"{escape(c)}={NULL_DIR if values[c] is None else escape(values[c])}"
                    for c in partition_by)


def parse_directory(rel: str, types: dict[str, pa.DataType]) -> dict[str, str | None]:
    """The serialized partition values of a file written by Spark's ``partitionBy`` from its
    path below the unit (``col=value/.../file``). Spark writes the values as strings of their
    type (timestamps in the session time zone, which the JVM path requires to be UTC); they are
    parsed and serialized again, so both writers log identical values."""
    out: dict[str, str | None] = {}
    for part in rel.split("/")[:-1]:
        name, sep, raw = part.partition("=")
        col = unquote(name)
        if not sep or col not in types:
            continue
        text = unquote(raw)
        out[col] = None if raw == NULL_DIR or text == "" else serialize(_typed(text, types[col]))
    missing = [c for c in types if c not in out]
    if missing:
        raise ValueError(f"{rel}: no directory for partition column(s) {', '.join(missing)}")
    return out


def _typed(text: str, t: pa.DataType) -> Any:
    if pa.types.is_boolean(t):
        return text.lower() == "true"
    if pa.types.is_integer(t):
        return int(text)
    if pa.types.is_date32(t):
        return dt.date.fromisoformat(text)
    if pa.types.is_timestamp(t):
        return dt.datetime.fromisoformat(text)
    if pa.types.is_decimal(t):
        return decimal.Decimal(text)
    return text


def split(batch: pa.RecordBatch | pa.Table, partition_by: Sequence[str]
          ) -> Iterator[tuple[dict[str, str | None], pa.Table]]:
    """The rows of ``batch`` per partition value: (serialized values, rows without the
    partition columns). Nulls (and empty strings) form one group each column."""
    table = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])
    keys = {}
    for c in partition_by:
        col = table.column(c)
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            col = pc.if_else(pc.equal(col, ""), pa.scalar(None, col.type), col)
        keys[f"__p_{c}"] = col
    keyed = table.drop_columns(list(partition_by))
    for name, col in keys.items():
        keyed = keyed.append_column(name, col)
    names = list(keys)
    ordered = keyed.take(pc.sort_indices(keyed, sort_keys=[(n, "ascending", "at_end") for n in names]))
    groups = ordered.group_by(names, use_threads=False).aggregate([([], "count_all")])
    offset = 0
    counts = groups.column("count_all").to_pylist()
    values = [groups.column(n).to_pylist() for n in names]
    for i, count in enumerate(counts):
        part = {c: serialize(values[j][i]) for j, c in enumerate(partition_by)}
        yield part, ordered.slice(offset, count).drop_columns(names)
        offset += count


def parse_partition_by(text: str | None) -> tuple[str, ...] | None:
    """The ``partition_by`` option: a JSON list or comma-separated names; None when not given."""
    if text is None or not text.strip():
        return None
    text = text.strip()
    if text.startswith("["):
        import json

        try:
            names = json.loads(text)
        except ValueError:
            names = None
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            raise ConfigError(f"onceflow-delta: partition_by={text!r} is not a JSON list of column names")
        return tuple(names)
    return tuple(n.strip() for n in text.split(",") if n.strip())
