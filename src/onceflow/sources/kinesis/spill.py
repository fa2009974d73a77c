"""Records the driver read while planning, kept for the executor that reads the same range.

Kinesis has no call that returns a shard's newest sequence number, so the driver reads a
batch's records to find where the batch ends. Reading them again on an executor would double
the shard's read traffic (its 2 MB/s and 5 GetRecords/s are shared by every consumer) and
halve throughput. With ``eventLog`` (the checkpoint directory, set under a onceflow Job) the
driver writes what it read to ``<checkpoint>/_onceflow/kinesis-spill/`` as one file per shard
range, under a temporary name renamed once complete; the executor task of that range reads the
file instead of Kinesis.

File layout (one file per range ``(start, end]`` of one shard)::

    <Arrow IPC stream: schema, record batches, end-of-stream marker>   `bytes` bytes
    <trailer: UTF-8 JSON {"v", "stream", "shard", "start", "end", "last", "rows", "bytes",
              "sha256"}>
    <trailer length: 4 bytes, little-endian>
    <magic: b"OFSPILL1">

The trailer is written after the data, so a file cut anywhere lacks it (or its data no
longer has the length and checksum it records); it carries the range, the record count, the
data's byte length and SHA-256, and the last sequence number written.

Guarantees:

- Publication: the file is written under a temporary name, flushed and (on a local
  filesystem) fsynced, then renamed to its final name, and the directory is fsynced after the
  rename; on an object store the upload of the complete file is the publication. A host crash
  therefore leaves either no file, a temporary file (deleted by :func:`cleanup`), or a whole
  one; a file damaged all the same (a filesystem without fsync, a disk error, a hand-edited
  or truncated file) is caught by the reader.
- Use: the executor uses a file only when its trailer is present, names this very range
  (stream, shard, start, end; for a sequence-number end, the last record written is that
  end), and the data has the recorded length and SHA-256; the record count is checked again
  while reading. Anything else: the file is removed, one WARNING line says why, and the task
  reads the range from Kinesis, which yields the same rows. A missing file (a replay after a
  restart, a cleaned directory) also means reading Kinesis.
- Cost: the reader checks the checksum in one pass over the file before yielding any row (a
  row is never yielded from a file that turns out bad), then reads it again to yield the
  batches (from the page cache locally); memory stays at one Arrow batch.
- Files of committed ranges are deleted when Spark commits the batch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import uuid
from collections.abc import Iterator
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.compute as pc

from onceflow.errors import SourceError
from onceflow.sources.kinesis.options import NAME, SHARD_END, Positions, Settings, after, is_seq

log = logging.getLogger("onceflow.sources.kinesis")

SPILL_DIR = "_onceflow/kinesis-spill"


def to_arrow(records: list[dict], stream: str, shard: str, schema: pa.Schema) -> pa.RecordBatch:
    """GetRecords records -> an Arrow batch of the source schema (timestamps: epoch seconds)."""
    n = len(records)
    arrays = []
    for f in schema:
        if f.name == "data":
            arrays.append(pa.array([r["Data"] for r in records], f.type))
        elif f.name == "stream":
            arrays.append(pa.repeat(pa.scalar(stream, f.type), n))
        elif f.name == "shardId":
            arrays.append(pa.repeat(pa.scalar(shard, f.type), n))
        elif f.name == "sequenceNumber":
            arrays.append(pa.array([r["SequenceNumber"] for r in records], f.type))
        elif f.name == "partitionKey":
            arrays.append(pa.array([r["PartitionKey"] for r in records], f.type))
        elif f.name == "approximateArrivalTimestamp":
            micros = pa.array([float(r.get("ApproximateArrivalTimestamp") or 0) * 1e6 for r in records],
                              pa.float64())
            arrays.append(pc.cast(micros, pa.int64(), safe=False).cast(f.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _dir(s: Settings) -> str | None:
    return f"{s.event_log.rstrip('/')}/{SPILL_DIR}" if s.event_log else None


def _name(stream: str, shard: str, start: str, end: str) -> str:
    start_key = hashlib.sha256(start.encode()).hexdigest()[:12]
    return f"{stream}~{shard}~{start_key}~{end}.arrow"


MAGIC = b"OFSPILL1"
_TAIL = struct.Struct("<I8s")  # trailer length, magic
_CHUNK = 1 << 20


class _Hashing:
    """The file object the Arrow writer writes to: counts and hashes every byte it forwards."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.size, self.sha = f, 0, hashlib.sha256()
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha.update(view)
        self.size += view.nbytes
        self.f.write(view)
        return view.nbytes

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def close(self) -> None:  # the Arrow writer does not own the file
        self.closed = True


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SpillWriter:
    """Driver: streams one shard range's records to a file while the range is read ahead."""

    def __init__(self, s: Settings, stream: str, shard: str, start: str, schema: pa.Schema) -> None:
        from onceflow.storage import is_local, url_to_fs

        self.stream, self.shard, self.start, self.schema = stream, shard, start, schema
        self.fs, self.dir = url_to_fs(_dir(s))
        self.local = is_local(self.fs)
        self.fs.makedirs(self.dir, exist_ok=True)
        self.tmp = f"{self.dir}/.{uuid.uuid4().hex}.tmp"
        self._file = self.fs.open(self.tmp, "wb")
        self._data = _Hashing(self._file)
        self._writer = pa.ipc.new_stream(self._data, schema)
        self.rows, self.last = 0, start

    def add(self, records: list[dict]) -> None:
        if records:
            self._writer.write_batch(to_arrow(records, self.stream, self.shard, self.schema))
            self.rows += len(records)
            self.last = records[-1]["SequenceNumber"]

    def finish(self, end: str) -> None:
        """Publish the file as the range ``(start, end]``: data, trailer, fsync, rename,
        directory fsync (see the module's guarantees)."""
        self._writer.close()
        trailer = json.dumps({"v": 1, "stream": self.stream, "shard": self.shard, "start": self.start,
                              "end": end, "last": self.last, "rows": self.rows, "bytes": self._data.size,
                              "sha256": self._data.sha.hexdigest()}, sort_keys=True).encode()
        self._file.write(trailer + _TAIL.pack(len(trailer), MAGIC))
        self._file.flush()
        if self.local:
            os.fsync(self._file.fileno())
        self._file.close()
        self.fs.mv(self.tmp, f"{self.dir}/{_name(self.stream, self.shard, self.start, end)}")
        if self.local:
            _fsync_dir(self.dir)

    def abort(self) -> None:
        try:
            self._writer.close()
            self._file.close()
            self.fs.rm(self.tmp)
        except (OSError, pa.ArrowException):
            pass


def spill_writer(s: Settings, stream: str, shard: str, start: str, schema: pa.Schema) -> SpillWriter | None:
    """A writer when spilling is possible (``eventLog`` set and writable), else None."""
    if not s.event_log:
        return None
    try:
        return SpillWriter(s, stream, shard, start, schema)
    except OSError as e:
        log.warning("kinesis spill: cannot write under %s (%s); executors read Kinesis", _dir(s), e)
        return None


class BadSpill(Exception):
    """A spill file that must not be used (why: the message)."""


def _trailer(f: BinaryIO, size: int, want: dict[str, str]) -> dict[str, Any]:
    """The file's trailer, checked against the range ``want`` (else BadSpill)."""
    if size < _TAIL.size:
        raise BadSpill(f"{size} bytes, shorter than a trailer")
    f.seek(size - _TAIL.size)
    length, magic = _TAIL.unpack(f.read(_TAIL.size))
    if magic != MAGIC or length > size - _TAIL.size:
        raise BadSpill("no trailer at its end (cut short, or not written whole)")
    f.seek(size - _TAIL.size - length)
    try:
        meta = json.loads(f.read(length))
    except ValueError:
        raise BadSpill("unreadable trailer") from None
    if not isinstance(meta, dict) or meta.get("v") != 1:
        raise BadSpill("unknown trailer version")
    for key, value in want.items():
        if meta.get(key) != value:
            raise BadSpill(f"its trailer says {key}={meta.get(key)!r}, not {value!r}")
    if is_seq(want["end"]) and meta.get("last") != want["end"]:
        raise BadSpill(f"its last record is {meta.get('last')!r}, not the range's end {want['end']}")
    if meta.get("bytes") != size - _TAIL.size - length:
        raise BadSpill(f"{size - _TAIL.size - length} data bytes, its trailer says {meta.get('bytes')}")
    return meta


def _checksum(f: BinaryIO, n: int) -> str:
    f.seek(0)
    sha, left = hashlib.sha256(), n
    while left > 0:
        chunk = f.read(min(_CHUNK, left))
        if not chunk:
            break
        sha.update(chunk)
        left -= len(chunk)
    return sha.hexdigest()


def read_spill(s: Settings, stream: str, shard: str, start: str, end: str,
               schema: pa.Schema) -> Iterator[pa.RecordBatch] | None:
    """Executor: the range's batches from the driver's file, or None (read Kinesis).

    A file that fails a check (see the module's guarantees) is removed, with one WARNING."""
    if not s.event_log:
        return None
    from onceflow.storage import url_to_fs

    fs, d = url_to_fs(_dir(s))
    path = f"{d}/{_name(stream, shard, start, end)}"
    try:
        f = fs.open(path, "rb")
    except OSError:
        return None
    try:
        size = f.seek(0, os.SEEK_END)
        meta = _trailer(f, size, {"stream": stream, "shard": shard, "start": start, "end": end})
        if _checksum(f, meta["bytes"]) != meta["sha256"]:
            raise BadSpill("its data does not match the SHA-256 of its trailer")
        f.seek(0)
        reader = pa.ipc.open_stream(f)
        if reader.schema != schema:
            raise BadSpill("another schema")
    except (BadSpill, OSError, pa.ArrowException) as e:
        f.close()
        _discard(fs, path, e)
        return None

    def batches() -> Iterator[pa.RecordBatch]:  # streamed: a large range is not held in memory
        n = 0
        with f:
            for batch in reader:
                n += batch.num_rows
                yield batch
        if n != meta["rows"]:  # the checksum matched: only a writer bug gets here
            _discard(fs, path, BadSpill(f"{n} records read, its trailer says {meta['rows']}"))
            raise SourceError(f"{NAME}: spill file {path} held {n} records, its trailer says "
                              f"{meta['rows']}; it was removed, the task's retry reads Kinesis")

    return batches()


def _discard(fs: Any, path: str, why: BaseException) -> None:
    """Remove an unusable spill file, with one line saying why (the task reads Kinesis)."""
    try:
        fs.rm(path)
    except OSError:
        pass
    log.warning("%s: ignored and removed spill file %s (%s); reading the range from Kinesis",
                NAME, path, " ".join(str(why).split()) or type(why).__name__)


def cleanup(s: Settings, committed: Positions) -> None:
    """Delete the files of ranges that end at or before the committed positions, and
    temporary files (only this driver writes here, one range at a time: a temporary file seen
    between two ranges was left by a driver that died or was stopped while reading ahead)."""
    if not s.event_log:
        return
    from onceflow.storage import url_to_fs

    fs, d = url_to_fs(_dir(s))
    try:
        names = [p.rsplit("/", 1)[-1] for p in fs.ls(d, detail=False)]
    except (FileNotFoundError, NotADirectoryError):
        return
    for name in names:
        if name.startswith(".") and name.endswith(".tmp"):
            try:
                fs.rm(f"{d}/{name}")
            except OSError:
                pass
            continue
        parts = name[: -len(".arrow")].split("~") if name.endswith(".arrow") else []
        if len(parts) != 4:
            continue
        stream, shard, _, end = parts
        done = committed.get((stream, shard))
        if done is not None and (done == end or after(done, end) or (done == SHARD_END and is_seq(end))):
            try:
                fs.rm(f"{d}/{name}")
            except OSError:
                pass
