"""The Delta sink's files: the unit helpers of :mod:`onceflow.sinks.files` (imported here for
the Delta modules), and what the Delta log says about them (decisions per batch)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pyarrow as pa

from onceflow.sinks.files import (  # noqa: F401 - the Delta modules import these from here
    _DIR,
    _FILE,
    add_files,
    compatible,
    dictionary_columns,
    dir_name,
    file_name,
    losing_rule,
    orphan_rule,
    parse_unit,
    remove_units,
    sweep_prefixes,
    to_arrow_schema,
    unit,
)

if TYPE_CHECKING:
    from deltalake import DeltaTable


def recent_decisions(table: DeltaTable, lineage: str, versions: int) -> dict[int, frozenset[str]]:
    """batch -> decision units of this lineage's batches decided in the table's last
    ``versions`` log versions (one pass over their commit infos)."""
    found: dict[int, frozenset[str]] = {}
    for entry in table.history(limit=versions):
        meta = entry.get("onceflow")
        if isinstance(meta, str):
            meta = json.loads(meta)
        if meta and meta.get("lineage") == lineage and isinstance(meta.get("batch"), int):
            found.setdefault(meta["batch"], frozenset(unit(p) for p in meta.get("files", [])))
    return found


def commit_meta(table: DeltaTable, lineage: str, batch_id: int) -> dict | None:
    """onceflow's commit info (fingerprint, files) of batch N of this lineage, newest first.

    Looks at recent versions first and only then walks the whole remaining log.
    """
    for limit in (64, None):
        for entry in table.history(limit=limit):
            meta = entry.get("onceflow")
            if isinstance(meta, str):
                meta = json.loads(meta)
            if meta and meta.get("lineage") == lineage and meta.get("batch") == batch_id:
                return meta
    return None


def delta_schema(arrow_schema: pa.Schema):
    """The Delta schema of an Arrow schema."""
    from deltalake import Schema

    return Schema.from_arrow(arrow_schema)
