"""Creating a savepoint from a stopped job's checkpoint.

Which files a savepoint needs to resume after batch N (docs/protocol.md: batch N =
``offsets/N`` + state version N+1 + ``commits/N``):

* ``metadata`` (the lineage), ``offsets/N`` and ``commits/N`` plus ``offsets/N-1`` and
  ``commits/N-1`` (Spark 4.3 refuses to restart without the previous offset log entry), all
  of ``sources/``;
* ``offsets/N+1`` when batch N+1 was planned but not committed (a stop interrupted it, maybe
  after a sink had already decided it): the restored job replays N+1 from exactly these
  offsets, so a sink that decided N+1 sees the same fingerprint and skips it, instead of a
  re-planned N+1 that could differ (recorded as ``planned_batch`` in the manifest);
* per state store directory (``state/<op>/<partition>[/<store>]``): the newest snapshot at or
  below version N+1 (HDFS-backed ``V.snapshot`` / RocksDB ``V.zip``) and every later
  ``V.delta`` / ``V.changelog`` up to N+1 — exactly the chain Spark reads to load version
  N+1; for RocksDB only the SST files the chosen ``V.zip`` references; plus the operator and
  schema metadata (``_metadata``, ``_stateSchema``). With Spark's checkpoint format v2
  (``V_<uuid>.zip``) every versioned file up to N+1 is kept (Spark picks the right lineage).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import time
import zipfile
from collections import defaultdict
from importlib.metadata import PackageNotFoundError, version

from onceflow import __version__
from onceflow.checkpoint.eventlog import EventLog
from onceflow.checkpoint.layout import CheckpointDir
from onceflow.checkpoint.lease import DriverLease
from onceflow.errors import CheckpointError
from onceflow.savepoint.manifest import (
    DATA_DIR,
    MANIFEST,
    FileEntry,
    Manifest,
    SavepointError,
    StateOperator,
)
from onceflow.savepoint.transfer import copy_tree
from onceflow.storage import url_to_fs

log = logging.getLogger("onceflow.savepoint")

_VERSIONED = re.compile(r"^(?P<v>\d+)(?P<uid>_[0-9A-Za-z-]+)?\.(?P<ext>delta|snapshot|zip|changelog)$")
_SNAPSHOT_EXT = ("snapshot", "zip")
PROVIDER_KEY = "spark.sql.streaming.stateStore.providerClass"
HDFS_PROVIDER = "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider"


@functools.cache
def spark_version() -> str:
    try:
        return version("pyspark")
    except PackageNotFoundError:  # pragma: no cover - pyspark is a dependency
        return "unknown"


def live_lease_holder(checkpoint_url: str) -> dict | None:
    """The lease record of a live driver on this checkpoint, or None when it is stopped (a
    holder this process cannot check directly is watched until it renews or lapses)."""
    return DriverLease(checkpoint_url, "onceflow-savepoint").holder(settle=True)


def default_savepoint_dir(checkpoint_url: str) -> str:
    """``CHECKPOINT_DIR/../savepoints``: where savepoints go unless a target is given."""
    url = checkpoint_url.rstrip("/")
    parent = url.rsplit("/", 1)[0] if "/" in url.split("://", 1)[-1] else "."
    return f"{parent}/savepoints"


def default_target(checkpoint_url: str, batch: int, directory: str | None = None, prefix: str = "sp") -> str:
    """``DIRECTORY/<prefix>-<batch>-<UTC timestamp>``, DIRECTORY defaulting to
    ``CHECKPOINT_DIR/../savepoints``."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return f"{(directory or default_savepoint_dir(checkpoint_url)).rstrip('/')}/{prefix}-{batch}-{stamp}"


def _job_name(ckpt: CheckpointDir) -> str:
    name = None
    for e in EventLog(ckpt.url).read():
        if e.get("event") == "start" and e.get("job"):
            name = e["job"]
    return name or "unknown"


def select_files(ckpt: CheckpointDir, batch: int, planned: int | None = None,
                 partitions: int | None = None) -> list[str]:
    """Checkpoint-relative paths of the files needed to resume after ``batch`` (and to replay
    the uncommitted ``planned`` batch from its write-ahead offsets). ``partitions``: the
    batch's state partitions; directories of higher partitions (left behind by a rescale to
    fewer partitions) are not part of it."""
    root = ckpt.path.rstrip("/")
    all_files = [p for p in ckpt.fs.find(root, detail=False) if p.startswith(root + "/")]
    rels = [p[len(root) + 1 :] for p in all_files]
    chosen: list[str] = []
    stores: dict[str, list[tuple[int, str, str]]] = defaultdict(list)
    others_by_dir: dict[str, list[str]] = defaultdict(list)
    for rel in rels:
        base = rel.rsplit("/", 1)[-1]
        if base.startswith("."):  # Hadoop .crc checksums and temp files
            continue
        if rel == "metadata" or rel.startswith("sources/"):
            chosen.append(rel)
        elif rel in (f"offsets/{batch}", f"commits/{batch}", f"offsets/{batch - 1}", f"commits/{batch - 1}") or (
                planned is not None and rel == f"offsets/{planned}"):
            # Spark 4.3 validates that offsets/N-1 exists when restarting after batch N
            chosen.append(rel)
        elif rel.startswith("state/"):
            bits = rel.split("/")
            if partitions is not None and len(bits) > 3 and bits[2].isdigit() and int(bits[2]) >= partitions:
                continue
            m = _VERSIONED.match(base)
            parent = rel.rsplit("/", 1)[0]
            if m:
                stores[parent].append((int(m["v"]), m["ext"], rel))
            else:
                others_by_dir[parent].append(rel)
    wanted = batch + 1
    sst_dirs: dict[str, set[str] | None] = {}
    for store, files in stores.items():
        usable = [f for f in files if f[0] <= wanted]
        if any("_" in f[2].rsplit("/", 1)[-1] for f in usable):  # checkpoint format v2: keep all
            chosen += [f[2] for f in usable]
            sst_dirs[store] = None
            continue
        snaps = [f for f in usable if f[1] in _SNAPSHOT_EXT]
        base_v = max((f[0] for f in snaps), default=0)
        if not any(f[0] == wanted for f in usable) and files:
            raise CheckpointError(
                f"{ckpt.url}/{store} has no state file for version {wanted} (batch {batch}): "
                "the state was purged or never written; choose a later batch"
            )
        picked = [f for f in usable if (f[0] == base_v and f[1] in _SNAPSHOT_EXT) or
                  (f[0] > base_v and f[1] not in _SNAPSHOT_EXT)]
        chosen += [f[2] for f in picked]
        zips = [f[2] for f in picked if f[1] == "zip"]
        sst_dirs[store] = _referenced_ssts(ckpt, zips) if zips else set()
    for parent, files in others_by_dir.items():
        store = parent.removesuffix("/SSTs") if parent.endswith("/SSTs") else None
        if store is not None and store in sst_dirs and sst_dirs[store] is not None:
            keep = sst_dirs[store]
            chosen += [f for f in files if f.rsplit("/", 1)[-1] in keep]
        else:
            chosen += files
    return sorted(set(chosen))


def _referenced_ssts(ckpt: CheckpointDir, zips: list[str]) -> set[str] | None:
    """SST file names listed in RocksDB checkpoint zips; None (keep all) when unreadable."""
    names: set[str] = set()
    for rel in zips:
        try:
            with ckpt.fs.open(ckpt._p(rel), "rb") as f, zipfile.ZipFile(f) as z:
                lines = z.read("metadata").decode().splitlines()
            meta = json.loads(lines[1])
            names |= {s["dfsSstFileName"] for s in meta.get("sstFiles", [])}
        except (KeyError, ValueError, IndexError, zipfile.BadZipFile, OSError):
            return None
    return names


def read_operators(ckpt: CheckpointDir, files: list[str], partitions: int | None = None) -> list[StateOperator]:
    """Stateful operators from ``state/<op>/_metadata`` (names as Spark wrote them). Their
    partitions are the batch's ``partitions`` (``spark.sql.shuffle.partitions`` in its offsets:
    Spark's repartition does not rewrite ``_metadata``), else what ``_metadata`` says."""
    op_ids = sorted({int(r.split("/")[1]) for r in files if r.startswith("state/") and r.split("/")[1].isdigit()})
    ops = []
    for op in op_ids:
        name, stores, parts = None, [], set()
        for rel in files:
            bits = rel.split("/")
            if len(bits) > 2 and bits[1] == str(op) and bits[2].isdigit():
                parts.add(int(bits[2]))
            if len(bits) > 3 and bits[1] == str(op) and bits[2] == "_metadata":
                info = _operator_info(ckpt, rel)
                if info and name is None:
                    name = info["operatorInfo"].get("operatorName")
                    stores = info.get("stateStoreInfo") or []
        n_parts = partitions or max((s.get("numPartitions", 0) for s in stores), default=0) or len(parts)
        store_names = tuple(s.get("storeName", "default") for s in stores) or ("default",)
        ops.append(StateOperator(op, name, n_parts, store_names))
    return ops


def _operator_info(ckpt: CheckpointDir, rel: str) -> dict | None:
    try:
        with ckpt.fs.open(ckpt._p(rel), "r") as f:
            for line in f.read().splitlines():
                if line.startswith("{") and "operatorInfo" in line:
                    return json.loads(line)
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return None


def create_savepoint(
    checkpoint_url: str,
    target: str | None = None,
    *,
    batch: int | None = None,
    job_name: str | None = None,
    reason: str = "create",
) -> tuple[str, Manifest]:
    """Snapshot a stopped job's checkpoint at its last committed batch (or ``batch``).

    Returns (savepoint URL, manifest). Refuses while a driver holds the checkpoint's lease,
    and writes ``_savepoint.json`` last: a directory without it is an incomplete savepoint.
    ``reason`` is recorded in the event log's ``savepoint`` event (``stop`` for a stop with
    savepoint).
    """
    ckpt = CheckpointDir(checkpoint_url)
    if not ckpt.exists():
        raise SavepointError(f"{ckpt.url} is not a started Spark checkpoint (no 'metadata' file)")
    holder = live_lease_holder(ckpt.url)
    if holder:
        raise SavepointError(
            f"job {holder.get('job')!r} is running on {ckpt.url} (pid {holder.get('pid')} on "
            f"{holder.get('host')}); stop it first, or use 'onceflow stop --savepoint TARGET "
            f"{ckpt.url}' to stop it with a savepoint"
        )
    committed = ckpt.committed_batches()
    if batch is None:
        if not committed:
            raise SavepointError(f"{ckpt.url} has no committed batch yet; nothing to save")
        batch = committed[-1]
    elif batch not in committed or batch not in ckpt.offset_batches():
        raise SavepointError(
            f"{ckpt.url} has no committed batch {batch} (retained committed batches: "
            f"{committed[:1] + ['...'] + committed[-1:] if len(committed) > 2 else committed})"
        )
    offset_batches = ckpt.offset_batches()
    planned = batch + 1 if batch + 1 in offset_batches and batch + 1 not in committed else None
    offsets = ckpt.offsets(batch)
    conf = offsets.metadata.get("conf", {})
    shuffle = conf.get("spark.sql.shuffle.partitions")
    files = select_files(ckpt, batch, planned, int(shuffle) if shuffle else None)
    operators = read_operators(ckpt, files, int(shuffle) if shuffle else None)
    target = (target or default_target(ckpt.url, batch)).rstrip("/")
    dst_fs, dst_root = url_to_fs(target)
    if dst_fs.exists(dst_root) and dst_fs.ls(dst_root, detail=False):
        raise SavepointError(f"savepoint target {target} exists and is not empty; give a new directory")
    started = time.monotonic()
    try:
        copied = copy_tree(
            ((rel, ckpt._p(rel), f"{dst_root}/{DATA_DIR}/{rel}") for rel in files), ckpt.fs, dst_fs
        )
        manifest = Manifest(
            job=job_name or _job_name(ckpt), lineage=ckpt.lineage, batch=batch,
            source_offsets=ckpt.source_offsets(batch), planned_batch=planned,
            operators=operators,
            state_provider=(conf.get(PROVIDER_KEY) or HDFS_PROVIDER) if operators else conf.get(PROVIDER_KEY),
            shuffle_partitions=int(shuffle) if shuffle else None,
            spark_version=spark_version(), onceflow_version=__version__,
            created=round(time.time(), 3), created_from=ckpt.url,
            files=[FileEntry(f"{DATA_DIR}/{c.rel}", c.size, c.sha256) for c in copied],
        )
        with dst_fs.open(f"{dst_root}/{MANIFEST}", "w") as f:
            f.write(manifest.to_json())
    except BaseException:
        if dst_fs.exists(dst_root):
            dst_fs.rm(dst_root, recursive=True)
        raise
    elapsed = time.monotonic() - started
    log.info("savepoint of %s at batch %d: %s (%d files, %d bytes, %.2fs)",
             ckpt.url, batch, target, len(copied), manifest.total_bytes, elapsed)
    EventLog(ckpt.url).append("savepoint", path=target, batch=batch, lineage=manifest.lineage, reason=reason,
                              files=len(copied), bytes=manifest.total_bytes, seconds=round(elapsed, 3))
    return target, manifest
