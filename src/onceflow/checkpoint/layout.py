"""Reading Spark's streaming checkpoint layout (``metadata``, ``offsets/N``, ``commits/N``).

Works on any fsspec URL; local paths are plain paths. onceflow never writes Spark's files;
it only reads them to learn the lineage (query id) and each batch's planned offsets.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from functools import cached_property

import fsspec

from onceflow.errors import CheckpointError
from onceflow.storage import url_to_fs

#: what sinks keep in a checkpoint to save work (never needed for correctness): cleared by a
#: restore, since it describes the checkpoint's history before the restore
SINK_CACHE = "_onceflow/sink-cache"


@dataclass(frozen=True)
class BatchOffsets:
    """``offsets/N``: the write-ahead record of batch N's planned source offsets."""

    batch_id: int
    metadata: dict
    sources: tuple[str | None, ...]

    @property
    def fingerprint(self) -> str:
        """SHA-256 over the planned source offsets only (not timestamps or conf)."""
        return hashlib.sha256("\n".join(s or "-" for s in self.sources).encode()).hexdigest()[:32]


class CheckpointDir:
    """A Spark structured-streaming checkpoint directory on any filesystem URL.

    The URL is resolved once (filesystem and path, with the registered storage options); the
    object is then handed down to whatever works on the checkpoint (the event log, the lease,
    the runner), which take it instead of the URL (:meth:`of`)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs: fsspec.AbstractFileSystem
        self.fs, self.path = url_to_fs(self.url)

    @classmethod
    def of(cls, checkpoint: CheckpointDir | str) -> CheckpointDir:
        """``checkpoint`` itself, or the checkpoint directory at that URL."""
        return checkpoint if isinstance(checkpoint, CheckpointDir) else cls(checkpoint)

    def __repr__(self) -> str:
        return f"CheckpointDir({self.url!r})"

    def _p(self, *parts: str) -> str:
        return "/".join([self.path, *parts])

    def exists(self) -> bool:
        return self.fs.exists(self._p("metadata"))

    @cached_property
    def lineage(self) -> str:
        """The query id Spark stored in ``metadata`` (stable across restarts; read once per
        object: use :meth:`read_lineage` where a restore may just have rewritten it)."""
        return self.read_lineage()

    def ensure_lineage(self) -> str:
        """The lineage; for a new checkpoint, write Spark's ``metadata`` first (the query id
        Spark then adopts), so a sink can be opened for it before the query starts."""
        if not self.exists():
            self.fs.makedirs(self.path, exist_ok=True)
            with self.fs.open(self._p("metadata"), "w") as f:
                f.write(json.dumps({"id": str(uuid.uuid4())}, separators=(",", ":")))
        return self.read_lineage()

    def read_lineage(self) -> str:
        """The query id in ``metadata`` as it is now (CheckpointError when absent or corrupt)."""
        try:
            with self.fs.open(self._p("metadata"), "r") as f:
                return json.loads(f.readline())["id"]
        except FileNotFoundError:
            raise CheckpointError(
                f"checkpoint {self.url} has no 'metadata' file: it was never started, "
                "or this is not a Spark checkpoint directory"
            ) from None
        except (ValueError, KeyError) as e:
            raise CheckpointError(
                f"checkpoint {self.url}/metadata is corrupt ({e}); restore a savepoint "
                "or start the job on a new checkpoint directory"
            ) from None

    def _ids(self, sub: str) -> list[int]:
        try:
            names = self.fs.ls(self._p(sub), detail=False)
        except FileNotFoundError:
            return []
        ids = []
        for n in names:
            base = n.rstrip("/").rsplit("/", 1)[-1]
            if base.isdigit():
                ids.append(int(base))
        return sorted(ids)

    def offset_batches(self) -> list[int]:
        return self._ids("offsets")

    def committed_batches(self) -> list[int]:
        return self._ids("commits")

    def last_committed(self) -> int | None:
        ids = self.committed_batches()
        return ids[-1] if ids else None

    def offsets(self, batch_id: int) -> BatchOffsets:
        """Parse ``offsets/N`` (Spark's ``v1`` format: version, metadata JSON, one line per source)."""
        path = self._p("offsets", str(batch_id))
        try:
            with self.fs.open(path, "r") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {self.url} has no offsets/{batch_id}") from None
        if len(lines) < 2 or not lines[0].startswith("v"):
            raise CheckpointError(
                f"{self.url}/offsets/{batch_id} is corrupt (expected Spark's offset log format); "
                "restore a savepoint or start on a new checkpoint directory"
            )
        try:
            meta = json.loads(lines[1])
        except ValueError:
            raise CheckpointError(f"{self.url}/offsets/{batch_id}: metadata line is not JSON") from None
        sources = tuple(None if s == "-" else s for s in lines[2:])
        return BatchOffsets(batch_id, meta, sources)

    def source_offsets(self, batch_id: int) -> list[dict | str | None]:
        """Decoded per-source offsets of batch N (JSON where the source wrote JSON)."""
        out: list[dict | str | None] = []
        for s in self.offsets(batch_id).sources:
            try:
                out.append(json.loads(s) if s else None)
            except ValueError:
                out.append(s)
        return out


def require_checkpoint(url: str) -> CheckpointDir:
    """The checkpoint directory at ``url``; CheckpointError (one line) when the path does not
    exist or holds neither Spark's ``metadata`` nor onceflow's ``_onceflow/`` (a typo must not
    look like a stopped job). A job that was started has at least one of them."""
    ckpt = CheckpointDir(url)
    if not ckpt.fs.exists(ckpt.path):
        raise CheckpointError(f"{ckpt.url} does not exist: give the checkpoint directory of a job")
    if not ckpt.fs.isdir(ckpt.path):
        raise CheckpointError(f"{ckpt.url} is a file, not a checkpoint directory")
    if not (ckpt.exists() or ckpt.fs.isdir(ckpt._p("_onceflow"))):
        raise CheckpointError(f"{ckpt.url} is not a onceflow checkpoint (no 'metadata', no "
                              "'_onceflow/'): give the checkpoint directory of a job")
    return ckpt
