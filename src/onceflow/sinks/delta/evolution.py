"""Schema of the stream against the table's: strict (default) or ``schema_mode="merge"``.

Strict: the stream's columns are the table's, with compatible types (as before).
Merge (delta-rs's ``schema_mode="merge"`` for appends): a stream column the table lacks is
added to the table as a nullable column by a ``metaData`` action in the very commit that
decides the batch (so the new schema and the batch are visible together, or neither); a table
column the stream lacks must be nullable (its value is null in the new rows); a stream column
narrower than the table's (``int`` into ``bigint``, ``float`` into ``double``) is widened on
write. A stream column *wider* than the table's is refused: widening the table's type needs
Delta's ``typeWidening`` table feature, which delta-rs does not write.
"""

from __future__ import annotations

import json
from functools import lru_cache

import pyarrow as pa

from onceflow.errors import ConfigError
from onceflow.sinks.delta.files import compatible

SCHEMA_MODES = ("strict", "merge")

_INTS = [pa.int8(), pa.int16(), pa.int32(), pa.int64()]


def widens(stream: pa.DataType, table: pa.DataType) -> bool:
    """A stream value of type ``stream`` fits a table column of type ``table`` without loss."""
    if stream in _INTS and table in _INTS:
        return _INTS.index(stream) <= _INTS.index(table)
    return stream == pa.float32() and table == pa.float64()


@lru_cache(maxsize=64)
def arrow_of(schema_json: str) -> pa.Schema:
    """The Arrow schema of a Delta schema string (the log's ``schemaString``)."""
    from deltalake import Schema

    return pa.schema(Schema.from_json(schema_json).to_arrow())


def plan(stream: pa.Schema, table: pa.Schema | None, mode: str, where: str,
         url: str) -> tuple[pa.Schema, list[str]]:
    """(the schema the batch's files are written with, the stream columns the table lacks).

    Raises ConfigError naming every differing column when ``mode`` does not allow the
    difference."""
    if table is None:
        return stream, []
    have = {f.name: f for f in table}
    new = [f.name for f in stream if f.name not in have]
    missing = [n for n in have if n not in stream.names]
    changed = [f.name for f in stream if f.name in have and not compatible(f.type, have[f.name].type)]
    if mode != "merge":
        if new or missing or changed:
            parts = ([f"new column(s) {', '.join(new)}"] if new else []) + (
                [f"missing column(s) {', '.join(missing)}"] if missing else []) + (
                ["other type(s): " + ", ".join(f"{n} ({stream.field(n).type} vs table "
                                                f"{have[n].type})" for n in changed)] if changed else [])
            raise ConfigError(
                f"{where}: the stream's columns do not match table {url}: {'; '.join(parts)}. Use "
                "DeltaSink(..., schema_mode='merge') to add new nullable columns and widen "
                "narrower types, or select and cast matching columns in the transform"
            )
        return stream, []
    wider = [n for n in changed if not widens(stream.field(n).type, have[n].type)]
    required = [n for n in missing if not have[n].nullable]
    if wider or required:
        raise ConfigError(
            f"{where}: schema_mode='merge' cannot write to table {url}: " + "; ".join(
                ([("column(s) of a type the table's cannot hold: " + ", ".join(
                    f"{n} ({stream.field(n).type} vs table {have[n].type}: widening a table "
                    "column needs Delta's typeWidening feature)" for n in wider))] if wider else [])
                + ([f"no value for non-nullable table column(s) {', '.join(required)}"] if required else []))
            + "; cast or add these columns in the transform"
        )
    fields = [pa.field(f.name, have[f.name].type if f.name in changed else f.type) for f in stream]
    return pa.schema(fields), new


def merged_schema_json(table_json: str, stream: pa.Schema, new: list[str]) -> str:
    """The table's Delta schema string with ``new`` stream columns appended (nullable)."""
    from deltalake import Schema

    if not new:
        return table_json
    base = json.loads(table_json)
    added = json.loads(Schema.from_arrow(pa.schema([stream.field(n) for n in new])).to_json())
    for field in added["fields"]:
        field["nullable"] = True
    base["fields"] = base["fields"] + added["fields"]
    return json.dumps(base, separators=(",", ":"))
