"""Decoding Kafka record values without ever dropping a poison record silently.

Spark's own decoders (``from_json`` in PERMISSIVE mode, ``cast``) turn a value they cannot
parse into nulls, which a later filter then drops without a trace. :func:`decode_values`
applies a user decoder to every record instead and, when the decoder raises:

* with ``dead_letter=URL``: writes the record (topic, partition, offset, key, value as
  base64, error) to ``URL/<topic>/<partition>/<offset>.json`` and leaves it out of the output.
  The file name is the record's position, so a replayed batch rewrites the same file: the
  dead-letter output is exactly-once by construction (idempotent), on any fsspec URL;
* without: fails the query with a ConfigError naming topic, partition and offset (a poison
  record fails again on every restart, so the restart strategy is not consulted).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pyarrow as pa

from onceflow.errors import ConfigError

META = ("topic", "partition", "offset")


def dead_letter_path(root: str, topic: str, partition: int, offset: int) -> str:
    return f"{root.rstrip('/')}/{topic}/{partition}/{offset:020d}.json"


def decode_values(
    df,
    decode: Callable[[bytes | None], Any],
    schema,
    dead_letter: str | None = None,
    keep: Sequence[str] = META,
):
    """Return ``df`` (rows of the Kafka source) as ``keep`` columns + the decoded ``schema``.

    ``decode(value_bytes)`` returns a dict (by field name) or a tuple in ``schema``'s order,
    and raises on bad input. ``schema``: a StructType or DDL string of the decoded fields.
    """
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import StructType, _parse_datatype_string

    decoded = schema if isinstance(schema, StructType) else _parse_datatype_string(schema)
    missing = [c for c in (*keep, *META, "value") if c not in df.columns]
    if missing:
        raise ConfigError(f"decode_values: input has no column(s) {', '.join(sorted(set(missing)))}; "
                          "use it on the Kafka source's rows")
    out = StructType([df.schema[c] for c in keep] + list(decoded.fields))
    arrow_out = to_arrow_schema(out, timezone="UTC")
    names = [f.name for f in decoded.fields]
    keep = tuple(keep)

    def apply(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            cols = batch.to_pydict()
            rows: dict[str, list] = {f.name: [] for f in out.fields}
            for i, value in enumerate(cols["value"]):
                try:
                    rec = decode(value)
                    vals = [rec.get(n) for n in names] if isinstance(rec, dict) else list(rec)
                    if len(vals) != len(names):
                        raise ValueError(f"decoder returned {len(vals)} fields, schema has {len(names)}")
                except Exception as e:  # noqa: BLE001 - any decoder failure is a poison record
                    where = (f"topic {cols['topic'][i]} partition {cols['partition'][i]} "
                             f"offset {cols['offset'][i]}")
                    if dead_letter is None:
                        raise ConfigError(
                            f"poison record at {where}: the decoder raised {type(e).__name__}: {e}. "
                            "Fix the producer or the decoder, or route bad records with "
                            "decode_values(..., dead_letter=URL)") from None
                    _write_dead_letter(dead_letter, cols, i, e)
                    continue
                for c in keep:
                    rows[c].append(cols[c][i])
                for n, v in zip(names, vals, strict=True):
                    rows[n].append(v)
            yield pa.RecordBatch.from_pydict(rows, schema=arrow_out)

    return df.mapInArrow(apply, out)


def _write_dead_letter(root: str, cols: dict, i: int, error: Exception) -> None:
    from onceflow.storage import url_to_fs

    topic, partition, offset = cols["topic"][i], cols["partition"][i], cols["offset"][i]
    key, value = cols.get("key", [None] * (i + 1))[i], cols["value"][i]
    record = {
        "topic": topic, "partition": partition, "offset": offset,
        "key_b64": base64.b64encode(key).decode() if key is not None else None,
        "value_b64": base64.b64encode(value).decode() if value is not None else None,
        "error": f"{type(error).__name__}: {error}",
    }
    fs, path = url_to_fs(dead_letter_path(root, topic, partition, offset))
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "w") as f:  # same name on replay: rewritten, never duplicated
        f.write(json.dumps(record))


def read_dead_letters(root: str) -> list[dict]:
    """Every dead-lettered record under ``root`` (sorted by topic, partition, offset)."""
    from onceflow.storage import url_to_fs

    fs, path = url_to_fs(root)
    if not fs.exists(path):
        return []
    out = []
    for p in sorted(fs.glob(f"{path.rstrip('/')}/*/*/*.json")):
        with fs.open(p, "r") as f:
            out.append(json.loads(f.read()))
    return sorted(out, key=lambda r: (r["topic"], r["partition"], r["offset"]))
