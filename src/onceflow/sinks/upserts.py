"""What every upsert sink shares (``write="upsert"``): the user-facing options, their options
on the wire, the delete flag Spark computes, and the last event per key of a batch.

Semantics every upsert sink keeps: ``keys`` identify a row; within a batch the last event per
key wins, deterministically (the largest ``order_by`` value, nulls losing; ties, and every
row without ``order_by``, broken by the batch's own order); a winning event whose delete flag
(``delete_when``, a SQL predicate Spark evaluates into :data:`DELETE_COLUMN`) is true deletes
its key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from onceflow.errors import ConfigError

#: the boolean column an upsert's ``delete_when`` is computed into by Spark (never written)
DELETE_COLUMN = "_onceflow_delete"


def parse_columns(text: str | None, sink: str, option: str = "keys") -> tuple[str, ...]:
    """Column names from an option: a JSON list or comma-separated; ConfigError in one line."""
    if not text:
        return ()
    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except ValueError:
            raise ConfigError(f"{sink}: {option}={text!r} is not a JSON list of column names") from None
        if not isinstance(value, list) or not all(isinstance(c, str) and c for c in value):
            raise ConfigError(f"{sink}: {option}={text!r}; give a list of column names")
        return tuple(value)
    return tuple(c.strip() for c in text.split(",") if c.strip())


def check_fields(sink: str, write: str, keys: str | Sequence[str] | None, delete_when: str | None,
                 order_by: str | None) -> list[str] | None:
    """A sink's upsert fields checked when it is built (ConfigError in one line naming
    ``sink``); returns ``keys`` as a list (a single string is one key)."""
    if isinstance(keys, str):
        keys = [keys]
    if write not in ("append", "upsert"):
        raise ConfigError(f"{sink}.write={write!r}; use 'append' or 'upsert'")
    if write == "upsert":
        if not keys or not all(isinstance(c, str) and c for c in keys):
            raise ConfigError(f"{sink}(write='upsert') needs keys=[...], the columns that identify a row")
    elif keys or delete_when or order_by:
        raise ConfigError(f"{sink}: keys, delete_when and order_by apply to write='upsert' only")
    return None if keys is None else list(keys)


def wire_options(write: str, keys: Sequence[str] | None, order_by: str | None,
                 delete_when: str | None) -> dict[str, str]:
    """The data source options of a sink's upsert fields (none for appends)."""
    if write != "upsert":
        return {}
    opts = {"write": "upsert", "keys": json.dumps(list(keys or ()))}
    if order_by:
        opts["order_by"] = order_by
    if delete_when:
        opts["delete_column"] = DELETE_COLUMN
    return opts


def parse_wire(opts: Mapping[str, str], fmt: str) -> tuple[tuple[str, ...], str | None, str | None] | None:
    """(keys, order_by, delete_column) of a data source's ``write=upsert`` options; None for
    appends. Bad options: ConfigError naming the format ``fmt``."""
    write = opts.get("write") or "append"
    if write not in ("append", "upsert"):
        raise ConfigError(f"{fmt}: write={write!r}; use 'append' or 'upsert'")
    keys = parse_columns(opts.get("keys"), fmt)
    if write == "append":
        stray = [k for k in ("keys", "order_by", "delete_column") if opts.get(k)]
        if stray:
            raise ConfigError(f"{fmt}: option {stray[0]} applies to write='upsert' only")
        return None
    if not keys:
        raise ConfigError(f"{fmt}: write='upsert' needs keys (the columns that identify a row)")
    if len(set(keys)) != len(keys):
        raise ConfigError(f"{fmt}: keys={list(keys)} names a column twice")
    return keys, opts.get("order_by") or None, opts.get("delete_column") or None


def with_delete_flag(df: Any, predicate: str | None, sink: str) -> Any:
    """``df`` plus :data:`DELETE_COLUMN` = ``predicate`` (a SQL predicate over its columns),
    analysed now; ``df`` itself without a predicate. ConfigError in one line for a predicate
    Spark rejects, or a stream that already has the column."""
    if not predicate:
        return df
    from pyspark.errors import PySparkException
    from pyspark.sql import functions as F

    if DELETE_COLUMN in df.columns:
        raise ConfigError(f"{sink}: the stream has a column {DELETE_COLUMN}, which delete_when computes")
    try:
        out = df.withColumn(DELETE_COLUMN, F.expr(predicate).cast("boolean"))
        out.schema  # noqa: B018 - analyse now: a bad predicate fails here, in one line
    except PySparkException as e:
        first = str(e).strip().splitlines()[0]
        raise ConfigError(f"{sink}(delete_when={predicate!r}) is not a SQL predicate over the stream's "
                          f"columns ({', '.join(df.columns)}): {first}") from None
    return out


def last_per_key(rows: pa.Table, keys: Sequence[str], order_by: str | None) -> pa.Table:
    """The last event per key of ``rows`` (given in batch order), vectorised (one sort, one
    group-by over the keys alone): the largest ``order_by`` value wins (nulls lose), ties
    broken by position; the winners keep the batch's order."""
    n = rows.num_rows
    if n == 0:
        return rows
    position = np.arange(n, dtype=np.int64)
    if order_by:
        value = rows.column(order_by)  # nulls first: sorted by (has a value, value, position)
        order = pc.sort_indices(pa.table({"v": pc.is_valid(value), "o": value, "p": position}),
                                sort_keys=[("v", "ascending"), ("o", "ascending"), ("p", "ascending")]).to_numpy()
        rank = np.empty(n, dtype=np.int64)
        rank[order] = position
    else:
        order, rank = position, position
    ranked = rows.select(list(keys)).append_column("__onceflow_rank", pa.array(rank))
    best = ranked.group_by(list(keys), use_threads=False).aggregate([("__onceflow_rank", "max")])
    winners = np.sort(order[best.column("__onceflow_rank_max").to_numpy()])
    return rows.take(pa.array(winners))
