"""The savepoint format: a directory with ``_savepoint.json`` and ``checkpoint/``.

::

    SP/
      _savepoint.json          the manifest (this module)
      checkpoint/              the Spark checkpoint files needed to resume after batch N:
        metadata               query id (the lineage)
        offsets/N  commits/N   the last committed batch (write-ahead offsets + commit),
        offsets/N-1 commits/N-1  and the one before (Spark checks it on restart)
        [offsets/N+1]          batch N+1 if it was planned but not committed (replayed as is)
        sources/...            source metadata logs
        state/<op>/...         state store files for state version N+1 only

Every path in the manifest is relative to ``SP/``, so a savepoint can be moved or copied to
any filesystem URL and restored from there. Each file carries its size and SHA-256; restoring
verifies both and refuses a savepoint whose files were changed, truncated or removed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from onceflow.errors import OnceflowError
from onceflow.storage import url_to_fs

FORMAT_VERSION = 1
MANIFEST = "_savepoint.json"
DATA_DIR = "checkpoint"


class SavepointError(OnceflowError):
    """A savepoint cannot be created, read or restored (the message says why and what to do)."""


@dataclass(frozen=True)
class FileEntry:
    """One file of the savepoint: path relative to the savepoint root, size, SHA-256."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class StateOperator:
    """A stateful operator as Spark recorded it in ``state/<id>/_metadata``."""

    id: int
    name: str | None
    partitions: int
    stores: tuple[str, ...] = ("default",)


@dataclass
class Manifest:
    """Contents of ``_savepoint.json``."""

    job: str
    lineage: str
    batch: int
    source_offsets: list[Any]
    operators: list[StateOperator]
    state_provider: str | None
    shuffle_partitions: int | None
    spark_version: str
    onceflow_version: str
    created: float
    created_from: str
    files: list[FileEntry] = field(default_factory=list)
    #: batch N+1, planned (``offsets/N+1`` kept) but not committed when the savepoint was taken
    planned_batch: int | None = None
    format_version: int = FORMAT_VERSION
    kind: str = "savepoint"

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def stateful(self) -> bool:
        return bool(self.operators)

    def to_json(self) -> str:
        data = asdict(self)
        data["files"] = [asdict(f) for f in self.files]
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> Manifest:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise SavepointError(f"{where}/{MANIFEST} is not valid JSON ({e}); the savepoint is damaged") from None
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise SavepointError(
                f"{where}: savepoint format version {version!r} is not supported by this onceflow "
                f"(it reads version {FORMAT_VERSION}); use the onceflow version that wrote it"
            )
        try:
            data["operators"] = [
                StateOperator(o["id"], o.get("name"), o["partitions"], tuple(o.get("stores") or ("default",)))
                for o in data["operators"]
            ]
            data["files"] = [FileEntry(f["path"], int(f["size"]), f["sha256"]) for f in data["files"]]
            return cls(**data)
        except (KeyError, TypeError) as e:
            raise SavepointError(f"{where}/{MANIFEST} is incomplete ({e}); the savepoint is damaged") from None


def read_manifest(url: str) -> Manifest:
    """Read ``URL/_savepoint.json``; a clear error if URL is not a savepoint."""
    url = url.rstrip("/")
    fs, path = url_to_fs(url)
    try:
        with fs.open(f"{path}/{MANIFEST}", "r") as f:
            text = f.read()
    except FileNotFoundError:
        what = "does not exist" if not fs.exists(path) else f"has no {MANIFEST}"
        raise SavepointError(
            f"{url} {what}: not a savepoint (create one with 'onceflow savepoint create CHECKPOINT_DIR')"
        ) from None
    return Manifest.from_json(text, url)


def is_savepoint(url: str) -> bool:
    fs, path = url_to_fs(url.rstrip("/"))
    return fs.exists(f"{path.rstrip('/')}/{MANIFEST}")
