"""Records the driver read while planning, kept for the executor that reads the same range.

Kinesis has no call that returns a shard's newest sequence number, so the driver reads a
batch's records to find where the batch ends. Reading them again on an executor would double
the shard's read traffic (its 2 MB/s and 5 GetRecords/s are shared by every consumer) and
halve throughput. With ``eventLog`` (the checkpoint directory, set under a onceflow Job) the
driver writes what it read to ``<checkpoint>/_onceflow/kinesis-spill/`` as one Arrow IPC file
per shard range, under a temporary name renamed once complete; the executor task of that
range reads the file instead of Kinesis.

Guarantees: a file holds exactly the records of ``(start, end]`` of one shard (its name
carries stream, shard, a hash of start and the end), so reading it or Kinesis gives the same
rows; a missing or unreadable file (a replay after a restart, a cleaned directory) means
reading Kinesis. Files of committed ranges are deleted when Spark commits the batch.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from onceflow.sources.kinesis.options import SHARD_END, Positions, Settings, after, is_seq

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


class SpillWriter:
    """Driver: streams one shard range's records to a file while the range is read ahead."""

    def __init__(self, s: Settings, stream: str, shard: str, start: str, schema: pa.Schema) -> None:
        from onceflow.storage import url_to_fs

        self.stream, self.shard, self.start, self.schema = stream, shard, start, schema
        self.fs, self.dir = url_to_fs(_dir(s))
        self.fs.makedirs(self.dir, exist_ok=True)
        self.tmp = f"{self.dir}/.{uuid.uuid4().hex}.tmp"
        self._file = self.fs.open(self.tmp, "wb")
        self._writer = pa.ipc.new_stream(self._file, schema)

    def add(self, records: list[dict]) -> None:
        if records:
            self._writer.write_batch(to_arrow(records, self.stream, self.shard, self.schema))

    def finish(self, end: str) -> None:
        """Close and publish the file as the range ``(start, end]``."""
        self._writer.close()
        self._file.close()
        self.fs.mv(self.tmp, f"{self.dir}/{_name(self.stream, self.shard, self.start, end)}")

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


def read_spill(s: Settings, stream: str, shard: str, start: str, end: str,
               schema: pa.Schema) -> Iterator[pa.RecordBatch] | None:
    """Executor: the range's batches from the driver's file, or None (read Kinesis)."""
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
        reader = pa.ipc.open_stream(f)
    except (OSError, pa.ArrowException):
        f.close()
        return None
    if reader.schema != schema:
        f.close()
        return None

    def batches() -> Iterator[pa.RecordBatch]:  # streamed: a large range is not held in memory
        with f:
            yield from reader

    return batches()


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
