"""``onceflow doctor --iceberg CATALOG TABLE``: what the Iceberg sink would commit to, read only.

Reports the catalog (reachable, its kind), the table (format version, partition spec, snapshot
count and current snapshot), and the onceflow lineages its metadata records: per (sink id,
lineage) the newest epoch and last decided batch (the table property the sink commits with every
snapshot), how many of its decision snapshots are still in the history, and whether they are
appends or upserts. Never commits, never fences a running job.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from onceflow.errors import OnceflowError
from onceflow.sinks.iceberg import catalog as catalogs
from onceflow.sinks.iceberg.fileio import with_storage
from onceflow.sinks.iceberg.state import BATCH, LINEAGE, SINK, lineage_state
from onceflow.sinks.iceberg.upsert import OUTPUTS


@dataclass(frozen=True)
class CheckResult:
    """One doctor check: ``ok`` False means the user has something to do (``detail`` says what)."""

    name: str
    ok: bool
    detail: str


def lineages(metadata: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """(sink id, lineage) -> epoch, last batch, decisions in the history, write kind."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for snap in metadata.snapshots:
        props = snap.summary.additional_properties if snap.summary is not None else {}
        if LINEAGE not in props or SINK not in props:
            continue
        entry = found.setdefault((props[SINK], props[LINEAGE]), {"decisions": 0, "write": "append"})
        if BATCH in props:
            entry["decisions"] += 1
            if OUTPUTS in props:
                entry["write"] = "upsert"
    for (sink, lineage), entry in found.items():
        state = lineage_state(metadata, sink, lineage)
        entry |= {"epoch": state.epoch, "batch": state.batch}
    return found


def doctor(catalog: str | Mapping[str, Any], table: str, warehouse: str | None = None,
           catalog_name: str = "onceflow", storage_options: Mapping[str, Any] | None = None) -> list[CheckResult]:
    """The checks, in order; the first failing one ends the list (nothing after it can run).
    An object-store warehouse is read with ``storage_options`` (default:
    ``ONCEFLOW_STORAGE_OPTIONS``), as the sink reads it."""
    if isinstance(catalog, str) and catalog.strip().startswith("{"):
        try:
            catalog = json.loads(catalog)
        except ValueError as e:
            return [CheckResult("catalog", False, f"not valid JSON: {e}")]
    if isinstance(catalog, str) and catalog.startswith("sqlite:///"):
        db = catalog.removeprefix("sqlite:///")
        if db and not db.startswith(":") and not os.path.exists(db):  # do not create it by looking
            return [CheckResult("catalog", False, f"no SQLite catalog at {db} (the sink creates it when its "
                                "query starts)")]
    try:
        spec = with_storage(catalogs.catalog_spec(catalog, warehouse, catalog_name), storage_options)
        cat = catalogs.load(spec)
    except OnceflowError as e:
        return [CheckResult("catalog", False, str(e))]
    kind = spec.get("type", "?")
    out = [CheckResult("catalog", True, f"{kind} catalog {catalogs.redacted(spec)} (name {catalog_name!r})")]
    if "." not in table:
        return [*out, CheckResult("table", False, f"{table!r}: give namespace.name")]
    try:
        t = cat.load_table(table)
    except Exception as e:  # noqa: BLE001 - NoSuchTableError or the catalog's database failing
        missing = type(e).__name__ in ("NoSuchTableError", "NoSuchNamespaceError")
        return [*out, CheckResult("table", False, f"{table} does not exist (the sink creates it when its query "
                                  "starts)" if missing else f"cannot load {table}: {e}")]
    meta = t.metadata
    out.append(CheckResult("table", True, f"{table} at {t.location()}"))
    out.append(CheckResult("format_version", meta.format_version in (1, 2, 3), f"v{meta.format_version}"))
    spec_fields = [f"{f.name}={f.transform}({meta.schema().find_column_name(f.source_id)})"
                   for f in t.spec().fields]
    out.append(CheckResult(
        "partition_spec", not spec_fields,
        "unpartitioned" if not spec_fields else
        f"{', '.join(spec_fields)}: the sink writes unpartitioned tables only (each batch's files are "
        "committed whole); write to an unpartitioned table",
    ))
    current = t.current_snapshot()
    out.append(CheckResult(
        "snapshots", True,
        f"{len(meta.snapshots)} snapshot(s)" + (f", current {current.snapshot_id}" if current else ", none yet")
        + "; expire old ones on your usual schedule (the state property survives expiration)",
    ))
    found = lineages(meta)
    if not found:
        out.append(CheckResult("onceflow_lineages", True, "none: no onceflow sink has committed to this table"))
    for (sink, lineage), e in sorted(found.items(), key=lambda kv: kv[0]):
        out.append(CheckResult(
            f"lineage {lineage}", True,
            f"sink_id {sink}, {e['write']}: epoch {e['epoch']}, last decided batch {e['batch']}, "
            f"{e['decisions']} decision snapshot(s) in the history",
        ))
    return out
