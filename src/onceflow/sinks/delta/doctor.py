"""``onceflow doctor --delta PATH``: what the Delta sink will meet in a table.

Reports the table's version, partitioning, schema and protocol (reader/writer versions and
table features), whether onceflow's constant-cost log path applies to its appends, the
onceflow lineages found in its recent commits (last batch and epoch each), and onceflow task
files left in its directory. Read-only: nothing is written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from onceflow.sinks.checks import CheckResult
from onceflow.sinks.delta.files import parse_unit
from onceflow.storage import delta_target, scheme_of, url_to_fs

#: commits read for the lineage report
_HISTORY = 1000


def doctor(path: str, storage_options: Mapping[str, Any] | None = None) -> list[CheckResult]:
    """The checks for the table at ``path``; the first fails when it cannot be read."""
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    url, opts = delta_target(path, dict(storage_options or {}))
    try:
        table = DeltaTable(url, storage_options=opts)
    except TableNotFoundError:
        fs, root = url_to_fs(path, dict(storage_options or {}))
        try:
            foreign = [n for n in fs.ls(root, detail=False) if not parse_unit(n.rstrip("/").rsplit("/", 1)[-1])]
        except (FileNotFoundError, NotADirectoryError):
            foreign = []
        if foreign:
            return [CheckResult("table", False, f"{path}: exists and is not a Delta table (no _delta_log); the "
                                "sink refuses it: give an empty or new directory, or an existing Delta table")]
        return [CheckResult("table", True, f"{path}: no Delta table yet; the sink creates it on its first batch")]
    except Exception as e:  # noqa: BLE001 - delta-rs raises several types; say which path failed
        return [CheckResult("table", False, f"{path}: cannot be read ({str(e).splitlines()[0]}); check the "
                            "path and storage options")]
    meta, proto = table.metadata(), table.protocol()
    features = sorted({*(proto.reader_features or ()), *(proto.writer_features or ())})
    parts = list(meta.partition_columns)
    fields = [f"{f.name} {f.type.type if hasattr(f.type, 'type') else f.type}" for f in table.schema().fields]
    local = scheme_of(url) in ("", "file")
    fast = local and proto.min_writer_version <= 2 and not features
    checks = [
        CheckResult("table", True, f"{path}: version {table.version()}, {len(table.file_uris())} data files"),
        CheckResult("partitioning", True, f"partitioned by {parts}" if parts else "not partitioned"),
        CheckResult("schema", True, ", ".join(fields)),
        CheckResult("protocol", True, f"reader v{proto.min_reader_version}, writer v{proto.min_writer_version}, "
                    f"table features: {', '.join(features) if features else 'none'}"),
        CheckResult("append_path", True, "constant-cost log appends (local table, writer v2, no features)" if fast
                    else "appends commit through delta-rs (" + ("not a local table" if not local else
                                                                "writer version or table features") + ")"),
        CheckResult("onceflow_lineages", True, _lineages(table)),
    ]
    leftovers = _task_files(url, path, opts if not local else None)
    checks.append(CheckResult("onceflow_task_files", True,
                              f"{leftovers} onceflow task file(s) not yet committed or cleaned up (recovery of "
                              "their job removes those of older epochs)" if leftovers else "none"))
    return checks


def _lineages(table: Any) -> str:
    """``lineage: batch N (epoch E)`` for each onceflow lineage in the last commits."""
    seen: dict[str, tuple[int, Any]] = {}
    for entry in table.history(limit=_HISTORY):
        meta = entry.get("onceflow")
        if isinstance(meta, str):
            meta = json.loads(meta)
        if meta and isinstance(meta.get("batch"), int):
            seen.setdefault(meta["lineage"], (meta["batch"], meta.get("epoch")))
    if not seen:
        return f"none in the last {_HISTORY} commits"
    return "; ".join(f"{lin}: batch {b} (epoch {e})" for lin, (b, e) in sorted(seen.items()))


def _task_files(url: str, path: str, opts: Mapping[str, Any] | None) -> int:
    fs, root = url_to_fs(path, dict(opts or {}))
    try:
        names = [n.rstrip("/").rsplit("/", 1)[-1] for n in fs.ls(root, detail=False)]
    except OSError:
        return 0
    return sum(1 for n in names if n.startswith("part-of-") and parse_unit(n))
