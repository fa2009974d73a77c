"""Constant-cost commits to a Delta table's log: the Delta sink's per-batch hot path.

delta-rs lists the whole ``_delta_log`` directory of a local table on every refresh and every
commit (and cleans expired entries after each commit), so a stream's commit cost grows with
the table's age: about 4 ms per batch at 100 versions, 18 ms at 3,000 (docs/delta-sink.md).
:class:`LocalLog` keeps what the decide step reads, the latest version and the app
transactions at it, and appends a version as Delta's put-if-absent of the next log entry: a
complete temporary file hard-linked to ``<version>.json``, which fails when that entry exists.

Guarantee: a :class:`LogSnapshot` is used only while the log provably has not moved since it
was taken. Before each use the log entry of its version must still be the same file (inode and
mtime: a table deleted and created again is noticed) and the next version must not exist; the
commit itself is conditional on the latter. Anything else (another writer's commit, a
successor's epoch, a replaced table) makes the caller load a delta-rs snapshot afresh.
Every ``delta.checkpointInterval`` versions (default 100) the caller has delta-rs write a
checkpoint and remove expired log entries, which delta-rs's post-commit hook would do.

:class:`StoreLog` does the same on S3, with the store's conditional create as the put-if-absent
and the entry's ETag as its identity.

Tasks read the log forward instead (:meth:`LocalLog.advance`): the state they last saw plus the
log entries written since, one read each and one for the entry not written yet, where a
delta-rs refresh listed the log directory and read each new entry twice (on S3: six requests
per task and batch instead of two; on S3 a task takes a state its process read within
:data:`TASK_REUSE_S` as it is). Their view is advisory: the decision checks everything again,
and a task skips a batch as decided only on a verified view.

Used only for local and S3 tables, appends, and protocols that need nothing but add actions and
metaData (writer version 2 or lower, no table features); every other commit goes through
delta-rs.
Partitioned tables included: each add carries its ``partitionValues``. A schema merge
(``schema_mode="merge"``) writes a ``metaData`` action with the merged schema in the same entry.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from dataclasses import replace as with_fields
from typing import Any
from urllib.parse import quote

from deltalake import DeltaTable
from fsspec.asyn import sync

from onceflow import __version__

#: errors of ``os.link`` that mean the filesystem has no hard links
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV}
#: new log entries a task reads forward at most; beyond, a delta-rs load (from its checkpoint)
MAX_FORWARD = 50
#: seconds a task reads forward from the state its process last knew first-hand (loaded,
#: checked whole, or appended); then it loads again (entries read forward are never checked to
#: be the table's: bounded staleness, e.g. a log cleaned up past the entry held, costs one load
#: a minute per Python worker)
FORWARD_MAX_AGE_S = 60.0
#: on S3, seconds for which a task takes the newest state its process holds as it is, with no
#: request (:meth:`LocalLog.advance`): a stream's tasks then read the log forward about once
#: every TASK_REUSE_S per Python worker instead of twice per task and batch (two GETs, about 10%
#: of a 1M-row batch's time on a local S3 server). Such a view may miss the last decisions: a
#: task of a replayed batch then writes it again, and the commit keeps the decided files and
#: removes the new ones (never a skip: that needs a verified view)
TASK_REUSE_S = 2.0
#: on S3, seconds for which the held entry's identity, checked by a look at it or known from
#: writing it (:meth:`LocalLog.append`), is not checked again (:meth:`LocalLog.snapshot`): the
#: decision right after its lookup, the next batch's lookup right after a decision. A table
#: deleted and created again within that time is not noticed (locally a ``stat`` checks always)
RECHECK_S = 0.5


@dataclass(frozen=True)
class LogSnapshot:
    """The log at ``version``: the app transaction versions a decision checks."""

    version: int
    ident: Any  # the version's log entry: (inode, mtime_ns) of a local file, an object's ETag
    txns: Mapping[str, int | None] = field(default_factory=dict)
    #: the table's metaData action at this version (``schemaString``, ``partitionColumns``...)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    #: False for a task's view read forward (:meth:`LocalLog.advance`): the entry it started
    #: from was not checked to be still the table's (a table deleted and created again)
    verified: bool = True

    @property
    def partition_columns(self) -> tuple[str, ...]:
        return tuple(self.metadata.get("partitionColumns") or ())

    @property
    def schema_json(self) -> str:
        return str(self.metadata["schemaString"])

    def transaction_version(self, app_id: str) -> int | None:
        """As :meth:`deltalake.DeltaTable.transaction_version` at this snapshot's version."""
        return self.txns[app_id]


class LocalLog:
    """The log of one local table (one per table and process; thread-safe)."""

    def __init__(self, root: str):
        self.root = root
        self.log_dir = os.path.join(root, "_delta_log")
        self._lock = threading.Lock()
        self._snap: LogSnapshot | None = None
        self._ahead: LogSnapshot | None = None  # the tasks' view (:meth:`advance`)
        self._checked: tuple[LogSnapshot, float] | None = None  # the last full look and when
        self._loaded_at = 0.0  # monotonic time the log's state was last known first-hand
        self._seen_at = 0.0  # monotonic time the newest state held was last read or known
        self.eligible = False
        #: False once the filesystem refused a hard link (then delta-rs commits, as before)
        self.links = True
        #: versions between checkpoints (the table's ``delta.checkpointInterval``)
        self.interval = 100
        #: whether checkpoints also remove expired log entries (``delta.enableExpiredLogCleanup``)
        self.cleanup = True

    def entry(self, version: int) -> str:
        return os.path.join(self.log_dir, f"{version:020d}.json")

    def _ident(self, version: int) -> Any:
        """What identifies the log entry of ``version`` (FileNotFoundError: there is none)."""
        st = os.stat(self.entry(version))
        return st.st_ino, st.st_mtime_ns

    def _exists(self, version: int) -> bool:
        return os.path.exists(self.entry(version))

    def _recheck_s(self) -> float:
        """How long a check of the held entry's identity stands (a ``stat`` here: not at all)."""
        return 0.0

    #: whether a look costs a request (S3): then ``snapshot(latest=False)`` leaves the check of
    #: the next entry to the conditional create; a local look is two ``stat`` calls and checks all
    remote = False

    def _read(self, version: int) -> tuple[bytes, Any] | None:
        """The entry of ``version`` and its identity, in one read; None when there is none."""
        try:
            with open(self.entry(version), "rb") as f:
                st = os.fstat(f.fileno())
                return f.read(), (st.st_ino, st.st_mtime_ns)
        except FileNotFoundError:
            return None

    def _create(self, version: int, data: bytes) -> Any | None:
        """Put the entry of ``version`` if absent: a complete temporary file hard-linked to its
        name; the new entry's identity. None when the entry exists or the filesystem has no hard
        links (nothing committed); OSError for any other failure to write (a full disk),
        nothing committed."""
        tmp = os.path.join(self.log_dir, f"_commit_{uuid.uuid4().hex}.json.tmp")
        try:
            with open(tmp, "wb") as f:  # a full disk raises here: nothing committed
                f.write(data)
            try:
                os.link(tmp, self.entry(version))  # put-if-absent: fails if the version exists
            except OSError as e:
                if not isinstance(e, FileExistsError) and e.errno not in _NO_LINKS:
                    raise
                if e.errno in _NO_LINKS:
                    self.links = False  # delta-rs commits from now on
                return None
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        return self._ident(version)

    def snapshot(self, apps: Iterable[str], latest: bool = True) -> LogSnapshot | None:
        """The latest state, if it is still the latest and holds ``apps``; else None.

        ``latest=False`` (on S3) leaves out the check that the next entry does not exist, for a
        caller whose next step is :meth:`append`: its conditional create is that check. The held
        entry's identity is not checked again within :meth:`_recheck_s` of the last check or of
        its own append (on S3: one HEAD request per batch instead of three)."""
        with self._lock:
            snap, checked = self._snap, self._checked
        if snap is None or not (self.eligible and self.links) or any(a not in snap.txns for a in apps):
            return None
        started = time.monotonic()
        fresh = checked is not None and checked[0] is snap and started - checked[1] < self._recheck_s()
        if not fresh:
            try:
                if self._ident(snap.version) != snap.ident:
                    return None  # the table was replaced
            except FileNotFoundError:
                return None
            with self._lock:
                self._checked = (snap, started)
        if not latest and self.remote:
            return snap
        if self._exists(snap.version + 1):
            return None
        if not fresh:
            self._known(snap, started, replace=False)
        return snap

    def _known(self, snap: LogSnapshot, at: float, replace: bool = True) -> None:
        """``snap`` is the log's state as of ``at`` (monotonic), first-hand: what was read
        forward before goes (it may stem from a replaced table). ``replace=False``: only if
        ``snap`` is still the one held (another thread may have appended meanwhile)."""
        with self._lock:
            if replace or self._snap is snap:
                self._snap, self._ahead, self._loaded_at, self._seen_at = snap, None, at, at

    def seed(self, apps: Iterable[str]) -> str | None:
        """The state held (first-hand, holding ``apps``) as a JSON seed for a process that holds
        none (:meth:`take_seed`): what the driver passes its query's tasks after ``open()``, so
        that fresh Python workers read the log forward from it instead of loading the table (on
        S3 about half a second per worker in a stream's first batch). None: nothing to pass."""
        apps = tuple(apps)
        with self._lock:
            snap, loaded_at = self._snap, self._loaded_at
        if snap is None or not (self.eligible and self.links) or any(a not in snap.txns for a in apps):
            return None
        return json.dumps({"version": snap.version, "ident": snap.ident, "txns": dict(snap.txns),
                           "metadata": dict(snap.metadata), "interval": self.interval, "cleanup": self.cleanup,
                           "known": time.time() - (time.monotonic() - loaded_at)}, default=str)

    def take_seed(self, seed: str) -> None:
        """Hold ``seed`` (:meth:`seed`) as a view read forward (``verified=False``, advisory) when
        this process holds no state of the log yet and the seed is younger than
        :data:`FORWARD_MAX_AGE_S` by the wall clock; otherwise, or when it cannot be parsed, do
        nothing (the task loads the table, as without a seed)."""
        with self._lock:
            if self._snap is not None or self._ahead is not None:
                return
        try:
            got = json.loads(seed)
            age = time.time() - float(got["known"])
            snap = LogSnapshot(int(got["version"]), got["ident"], dict(got["txns"]), dict(got["metadata"]),
                               verified=False)
            interval, cleanup = max(1, int(got["interval"])), bool(got["cleanup"])
        except (ValueError, TypeError, KeyError):
            return
        if not 0 <= age < FORWARD_MAX_AGE_S:
            return
        with self._lock:
            if self._snap is None and self._ahead is None:
                self.eligible, self.interval, self.cleanup = True, interval, cleanup
                self._ahead = snap
                self._loaded_at = self._seen_at = time.monotonic() - age

    def advance(self, apps: Iterable[str]) -> LogSnapshot | None:
        """A task's view: the newest state this process holds, brought forward by reading each
        log entry after it once (their ``txn`` and ``metaData`` actions applied in order), up
        to the first entry that does not exist. None when nothing is held for ``apps``, the
        state was last known first-hand more than :data:`FORWARD_MAX_AGE_S` ago, an entry changes the protocol or
        cannot be parsed, or more than :data:`MAX_FORWARD` entries are new: the caller then
        loads the table and calls :meth:`sync`. On S3, a state held that was read or known
        within :data:`TASK_REUSE_S` is returned as it is, without a request.

        Advisory (``verified=False``): the entry it starts from is not checked to be still the
        table's. What a task writes for is checked again by the decision; a task must confirm
        "already decided" on a verified view before it skips a batch."""
        apps = tuple(apps)
        with self._lock:
            held = [s for s in (self._snap, self._ahead) if s is not None]
            loaded_at, seen_at = self._loaded_at, self._seen_at
        started = time.monotonic()
        if not held or not (self.eligible and self.links) or started - loaded_at > FORWARD_MAX_AGE_S:
            return None
        snap = max(held, key=lambda s: s.version)
        if any(a not in snap.txns for a in apps):
            return None
        if self.remote and started - seen_at < TASK_REUSE_S:
            return with_fields(snap, verified=False) if snap.verified else snap
        txns, metadata, version, ident = dict(snap.txns), snap.metadata, snap.version, snap.ident
        for _ in range(MAX_FORWARD + 1):
            got = self._read(version + 1)
            if got is None:
                break
            data, ident = got
            try:
                for line in data.splitlines():
                    action = json.loads(line) if line.strip() else {}
                    if "protocol" in action:
                        return None
                    if "metaData" in action:
                        metadata = action["metaData"]
                    txn = action.get("txn")
                    if txn and txn.get("appId") in txns:
                        txns[txn["appId"]] = int(txn["version"])
            except (ValueError, TypeError, AttributeError, KeyError):
                return None  # not an entry this reader understands: delta-rs reads it
            version += 1
        else:
            return None
        ahead = LogSnapshot(version, ident, txns, metadata, verified=False)
        with self._lock:
            if self._ahead is None or self._ahead.version <= version:
                self._ahead, self._seen_at = ahead, max(self._seen_at, started)
        return ahead

    def sync(self, table: DeltaTable, apps: Iterable[str]) -> LogSnapshot | None:
        """Take the state of a freshly loaded delta-rs snapshot; None when this table's
        protocol needs more than add actions (then every commit goes through delta-rs)."""
        version = table.version()
        protocol, metadata = table.protocol(), table.metadata()
        config = metadata.configuration
        self.eligible = protocol.min_writer_version <= 2 and not protocol.writer_features
        try:
            self.interval = max(1, int(config.get("delta.checkpointInterval") or 100))
        except ValueError:
            self.interval = 100
        self.cleanup = str(config.get("delta.enableExpiredLogCleanup", "true")).lower() != "false"
        try:
            snap = LogSnapshot(version, self._ident(version), {a: table.transaction_version(a) for a in apps},
                               metadata_of(table))
        except FileNotFoundError:  # replaced while we looked: the caller loads it again
            return None
        self._known(snap, time.monotonic())
        return snap if self.eligible and self.links else None

    def append(self, snap: LogSnapshot, adds: list[dict[str, Any]], app_id: str, app_version: int,
               meta: dict[str, Any], schema_json: str | None = None) -> LogSnapshot | None:
        """Commit version ``snap.version + 1``: the adds (files: path, size, rows, mtime,
        partition values), the app transaction, onceflow's commit info and, with
        ``schema_json``, a metaData action carrying that schema. None when that version exists
        (the log moved since ``snap``, or the filesystem has no hard links: nothing was
        committed). Any other failure to write (a full disk) raises OSError, with nothing
        committed."""
        now = int(time.time() * 1000)
        metadata = dict(snap.metadata)
        if schema_json is not None:
            metadata["schemaString"] = schema_json
        lines = [
            {"commitInfo": {"timestamp": now, "operation": "WRITE",
                            "operationParameters": {"mode": "Append",
                                                    "partitionBy": json.dumps(list(snap.partition_columns))},
                            "engineInfo": f"onceflow/{__version__}", "onceflow": json.dumps(meta),
                            "clientVersion": f"onceflow-{__version__}"}},
            *([{"metaData": metadata}] if schema_json is not None else []),
            *({"add": {"path": quote(h["path"], safe="/="), "partitionValues": h.get("partition") or {},
                       "size": h["size"], "modificationTime": h["mtime"], "dataChange": True,
                       "stats": json.dumps({"numRecords": h["rows"]})}} for h in adds),
            {"txn": {"appId": app_id, "version": app_version, "lastUpdated": now}},
        ]
        version = snap.version + 1
        data = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines).encode()
        started = time.monotonic()
        ident = self._create(version, data)
        if ident is None:
            with self._lock:
                self._snap = None
            return None
        new = LogSnapshot(version, ident, {**snap.txns, app_id: app_version}, metadata)
        self._known(new, started)
        with self._lock:
            self._checked = (new, started)
        return new


class StoreLog(LocalLog):
    """The log of one table on S3, appended the same way: the store's conditional create is the
    put-if-absent (s3fs sends ``If-None-Match: *``; S3 answers 412 when the entry exists, which
    s3fs raises as FileExistsError, as delta-rs's own commits on S3 rely on), and an entry's
    ETag is its identity (a table deleted and created again is noticed). A look at the latest
    state costs two HEAD requests (the entry held, the next one: absent), one within
    :data:`RECHECK_S` of the last look or append; a stream's decision, coming right after the
    last one, thus costs the lookup's HEAD of the next entry (404) and the PUT, whose answer
    carries the new entry's ETag; a delta-rs commit refreshed the table (a listing of ``_delta_log`` and a GET
    per new entry) and then committed. A task's :meth:`advance` costs one GET per new entry
    (with its ETag) and one for the next, absent entry, at most once per :data:`TASK_REUSE_S`."""

    def __init__(self, fs: Any, root: str):
        super().__init__(root)
        self.fs = fs
        self.log_dir = f"{root.rstrip('/')}/_delta_log"

    def entry(self, version: int) -> str:
        return f"{self.log_dir}/{version:020d}.json"

    def _ident(self, version: int) -> Any:
        info = self.fs.info(self.entry(version))
        return info.get("ETag") or info.get("etag") or (info.get("size"), info.get("LastModified"))

    def _exists(self, version: int) -> bool:
        """One HEAD request: s3fs's ``exists`` follows a missing key (the usual answer here,
        twice per batch) with a listing of it as a directory."""
        call = getattr(self.fs, "call_s3", None)
        if call is not None:
            bucket, key, _ = self.fs.split_path(self.entry(version))
            try:
                call("head_object", self.fs.kwargs, Bucket=bucket, Key=key)
                return True
            except FileNotFoundError:
                return False
            except Exception:  # noqa: BLE001 - any other answer: s3fs's own check raises it as usual
                pass
        return bool(self.fs.exists(self.entry(version)))

    remote = True

    def _recheck_s(self) -> float:
        return RECHECK_S

    def _read(self, version: int) -> tuple[bytes, Any] | None:
        if getattr(self.fs, "_call_s3", None) is None:  # not s3fs: the body alone, no identity
            try:
                return self.fs.cat_file(self.entry(version)), None
            except FileNotFoundError:
                return None
        bucket, key, _ = self.fs.split_path(self.entry(version))

        async def get() -> tuple[bytes, Any]:
            # one GET (s3fs's cat_file asks for the size first): the body and its ETag
            resp = await self.fs._call_s3("get_object", self.fs.kwargs, Bucket=bucket, Key=key)
            try:
                return await resp["Body"].read(), resp.get("ETag")
            finally:
                resp["Body"].close()

        try:
            return sync(self.fs.loop, get)
        except FileNotFoundError:
            return None

    def _create(self, version: int, data: bytes) -> Any | None:
        call = getattr(self.fs, "call_s3", None)
        if call is None:
            try:
                with self.fs.open(self.entry(version), "xb") as f:
                    f.write(data)
            except FileExistsError:
                return None
            return self._ident(version)
        bucket, key, _ = self.fs.split_path(self.entry(version))
        try:  # as s3fs's own "xb" write of a small file: one conditional PUT, here keeping its ETag
            put = call("put_object", self.fs.kwargs, Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
        except FileExistsError:
            return None
        return put.get("ETag") or self._ident(version)


def metadata_of(table: DeltaTable) -> dict[str, Any]:
    """The table's current metaData action, as the log holds it."""
    m = table.metadata()
    return {"id": m.id, "name": m.name, "description": m.description,
            "format": {"provider": "parquet", "options": {}}, "schemaString": table.schema().to_json(),
            "partitionColumns": list(m.partition_columns), "createdTime": m.created_time,
            "configuration": dict(m.configuration)}


_LOGS: dict[str, LocalLog] = {}
_LOGS_LOCK = threading.Lock()


def local_log(root: str) -> LocalLog:
    """The process's :class:`LocalLog` of the table at local path ``root``."""
    with _LOGS_LOCK:
        return _LOGS.setdefault(root, LocalLog(root))


def store_log(fs: Any, root: str, key: str) -> StoreLog:
    """The process's :class:`StoreLog` of the table at ``root`` on ``fs`` (``key``: the table
    URL and its storage options)."""
    with _LOGS_LOCK:
        log = _LOGS.get(key)
        if not isinstance(log, StoreLog):
            log = _LOGS[key] = StoreLog(fs, root)
        return log
