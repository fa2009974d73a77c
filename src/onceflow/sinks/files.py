"""The files a two-phase-commit file sink (Delta, Iceberg) writes into its table directory,
and how it finds them again.

A *unit* is what one write attempt leaves in the table directory and what clean-up deletes
whole: a task file of the Arrow path, ``part-of-<lineage>-e<epoch>-b<batch>-p<part>-a<attempt>-
<uuid>.parquet``, or a per-batch directory of the Delta sink's JVM path, ``part-of-<lineage>-
e<epoch>-b<batch>-d<uuid>/`` holding the files Spark's Parquet writer wrote for one attempt of
the batch. Both names carry the lineage, the writer's epoch and the batch id, so recovery and
commit decide from the name alone what is an orphan. A handle's ``path`` (relative to the
table) starts with its unit. No table library here: the Iceberg sink uses these without
deltalake installed.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Iterable, Mapping
from functools import lru_cache
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from fsspec.implementations.local import LocalFileSystem
from pyspark.sql.pandas.types import to_arrow_schema as _to_arrow_schema
from pyspark.sql.types import StructType

from onceflow.errors import ConfigError
from onceflow.sinks.base import TaskInfo

_FILE = re.compile(
    r"^part-of-(?P<lineage>[0-9a-f-]{36})(?:-e(?P<epoch>\d+))?-b(?P<batch>\d+)-p(?P<part>\d+)"
    r"-a(?P<att>\d+)-[0-9a-f]+\.parquet$"
)
_DIR = re.compile(r"^part-of-(?P<lineage>[0-9a-f-]{36})-e(?P<epoch>\d+)-b(?P<batch>\d+)-d[0-9a-f]+$")


def to_arrow_schema(schema: StructType) -> pa.Schema:
    """Spark schema -> Arrow schema as Spark's Arrow batches carry it (timestamps in UTC)."""
    return _to_arrow_schema(schema, timezone="UTC")


def file_name(task: TaskInfo, epoch: int | None) -> str:
    """The Arrow path's task file name."""
    return (
        f"part-of-{task.lineage}-e{epoch or 0}-b{task.batch_id:010d}-p{task.partition:05d}"
        f"-a{task.attempt}-{uuid.uuid4().hex[:12]}.parquet"
    )


def dir_name(lineage: str, epoch: int | None, batch_id: int) -> str:
    """The JVM path's directory for one attempt of one batch (unique per attempt)."""
    return f"part-of-{lineage}-e{epoch or 0}-b{batch_id:010d}-d{uuid.uuid4().hex[:12]}"


def unit(path: str) -> str:
    """The unit (task file or per-batch directory) a handle's relative path belongs to."""
    return path.split("/", 1)[0]


def orphan_rule(keep: set[str], mine: int | None, last: int, last_files: set[str] | None,
                decided: Mapping[int, frozenset[str]] | None = None) -> Callable[[int, int, str], bool]:
    """Whether a file of (batch, epoch, name) is an orphan that recovery may delete: not in
    flight (``keep``), written under an older epoch than ``mine``, and either of a batch after
    the last decided one, or of the last decided batch but not in its decision (``last_files``;
    None: the decision's files are unknown, keep them all), or of an earlier batch whose
    decision ``decided`` lists (batch -> units) and does not name it (a straggler's late file)."""

    def orphan(b: int, e: int, name: str) -> bool:
        if name in keep or (mine is not None and e >= mine):
            return False
        if b > last:
            return True
        if b == last:
            return last_files is not None and name not in last_files
        return decided is not None and b in decided and name not in decided[b]

    return orphan


def losing_rule(batch_id: int, keep: set[str], mine: int | None,
                decided: Mapping[int, frozenset[str]]) -> Callable[[int, int, str], bool]:
    """Whether the commit of ``batch_id`` (decision units ``keep``) may delete a file of
    (batch, epoch, name): never one of a newer epoch than ``mine``; of this batch, one its
    decision does not list; of another batch, one that batch's decision (``decided``: batch ->
    units, the decisions this process knows) does not list. A decided batch is never in
    flight again, so such a file is a loser whatever its epoch: a straggler's, a speculative
    attempt's, a lost executor's or a zombie's, finished after the batch committed. A file
    deleted while its writer still writes it may reappear; a later commit deletes it again.
    Undecided batches (not in ``decided``) are never touched."""

    def losing(b: int, e: int, name: str) -> bool:
        if mine is not None and e > mine:
            return False
        if b == batch_id:
            return name not in keep
        return b in decided and name not in decided[b]

    return losing


@lru_cache(maxsize=65536)
def parse_unit(name: str) -> tuple[str, int, int] | None:
    """(lineage, epoch, batch) of a unit name, None for anything else (cached: clean-up
    parses every unit of the table directory after each batch)."""
    m = _FILE.match(name) or _DIR.match(name)
    return None if m is None else (m["lineage"], int(m["epoch"] or 0), int(m["batch"]))


#: A commit's sweep on an object store (:func:`sweep_prefixes`): every commit looks at its own
#: batch's units under the committing driver's epoch (one listing: a failed attempt's file goes
#: at its batch's commit); every SWEEP_RECENT-th batch's commit at the last 2 x SWEEP_RECENT
#: batches (the recent batches at every commit were two listings of a batch's twelve requests);
#: every SWEEP_ALL_EVERY-th batch at every batch the process decided, under that epoch and the
#: SWEEP_EPOCHS before it (the zombies of the last takeovers; older ones are recovery's, at the
#: next start). Late files are invisible (no decision lists them) until they go.
SWEEP_RECENT, SWEEP_ALL_EVERY, SWEEP_EPOCHS = 10, 100, 2


def _cover(low: int, high: int) -> list[str]:
    """At most two leading parts of 10-digit batch ids that hold every id in [low, high] and
    fewer than ten times as many ids."""
    k = 0
    while high // 10**k - low // 10**k > 1:
        k += 1
    return sorted({f"{b:010d}"[:10 - k] for b in (low, high)})


def sweep_prefixes(lineage: str, batch_id: int, mine: int | None, decided: Iterable[int]) -> list[str]:
    """Name prefixes a commit's sweep lists on an object store (see :data:`SWEEP_RECENT`). A
    table directory holds every file ever committed, so a listing of the whole lineage grew
    with the table's age (about 1,000 names per request); these follow the recent batches."""
    top = mine or 0
    if batch_id % SWEEP_ALL_EVERY == 0:
        low, epochs = min([batch_id, *decided]), range(top, max(-1, top - SWEEP_EPOCHS - 1), -1)
    elif batch_id % SWEEP_RECENT == 0:
        low, epochs = max(0, batch_id - 2 * SWEEP_RECENT), range(top, top - 1, -1)
    else:  # between sweeps: the batch's own units (a failed or retried attempt's), one listing
        return [f"part-of-{lineage}-e{top}-b{batch_id:010d}"]
    return [f"part-of-{lineage}-e{e}-b{p}" for e in epochs for p in _cover(low, batch_id)]


def _names(fs, path: str, prefixes: Iterable[str]) -> set[str]:
    """Names directly in ``path`` that start with one of ``prefixes``: one listing filtered by
    the store per prefix (its requests follow the matches, not the directory's size); locally,
    or where a filesystem's ``find`` takes no prefix, the whole directory filtered here."""
    prefixes = tuple(prefixes)
    if isinstance(fs, LocalFileSystem):  # names only: no stat per entry (the directory grows)
        return {n for n in os.listdir(path) if n.startswith(prefixes)}
    names: set[str] = set()
    try:
        for prefix in prefixes:
            names.update(full.rstrip("/").rsplit("/", 1)[-1]
                         for full in fs.find(path, maxdepth=1, withdirs=True, prefix=prefix))
    except TypeError:  # no prefixed listing here
        names = {full.rstrip("/").rsplit("/", 1)[-1] for full in fs.ls(path, detail=False)}
    return {n for n in names if n.startswith(prefixes)}


def remove_units(fs, path: str, lineage: str, predicate: Callable[[int, int, str], bool],
                 prefixes: Iterable[str] | None = None) -> int:
    """Delete this lineage's units for which ``predicate(batch, epoch, unit_name)`` holds
    (directories with everything in them); return how many. ``prefixes`` (on an object store:
    :func:`sweep_prefixes`): look only at units whose names start with one of them; locally,
    and by default (recovery), at every unit of the lineage."""
    removed = 0
    lineage_prefix = f"part-of-{lineage}-"
    if prefixes is None or isinstance(fs, LocalFileSystem):
        prefixes = [lineage_prefix]
    for name in sorted(_names(fs, path, prefixes)):
        parsed = parse_unit(name) if name.startswith(lineage_prefix) else None
        if parsed and parsed[0] == lineage and predicate(parsed[2], parsed[1], name):
            try:
                fs.rm(f"{path}/{name}", recursive=True)
            except FileNotFoundError:  # removed meanwhile (another clean-up): same outcome
                pass
            removed += 1
    return removed


def dictionary_columns(batch: pa.RecordBatch, sample: int = 10_000) -> list[str] | bool:
    """Columns worth dictionary-encoding, judged on the first rows: those with few distinct
    values. A column of mostly unique values (ids, timestamps) would be dictionary-encoded
    until the dictionary page fills and then fall back: twice the encoding work for a larger
    file. Nested schemas keep Parquet's default (every column)."""
    if any(pa.types.is_nested(f.type) for f in batch.schema):
        return True
    head = batch.slice(0, sample)
    keep = []
    for name, column in zip(head.schema.names, head.columns, strict=True):
        try:
            if pc.count_distinct(column).as_py() <= 0.3 * len(column):
                keep.append(name)
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
            keep.append(name)
    return keep


def compatible(a: pa.DataType, b: pa.DataType) -> bool:
    """A stream column of type ``a`` may be appended to a table column of type ``b``."""
    if a == b:
        return True
    norm = {pa.large_string(): pa.string(), pa.large_binary(): pa.binary(), pa.string_view(): pa.string()}
    a, b = norm.get(a, a), norm.get(b, b)
    if pa.types.is_timestamp(a) and pa.types.is_timestamp(b):
        return True
    return a == b


def add_files(handles: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The data files of decision handles: a handle is one file, or (a partitioned task's
    directory) lists its files under ``files``."""
    return [f for h in handles for f in (h.get("files") or [h])]


#: Parquet codecs pyarrow writes
PARQUET_CODECS = ("zstd", "snappy", "lz4", "gzip", "brotli", "none")


def parquet_codec(codec: str, what: str) -> str:
    """``codec`` as pyarrow names it; ConfigError naming ``what`` and the choices otherwise."""
    name = str(codec).strip().lower()
    if name not in PARQUET_CODECS:
        raise ConfigError(f"{what}={codec!r}: use one of {', '.join(PARQUET_CODECS)}")
    return name
