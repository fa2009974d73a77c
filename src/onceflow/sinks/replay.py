"""What a replayed task compares before it skips a partition committed by an earlier attempt.

Sinks whose tasks make rows visible on their own (Kafka, PostgreSQL ``idempotent``) keep a
marker per (sink, lineage, batch, partition). A replay of batch N must not skip partition p
because a marker with that *number* exists: Spark may hand the replay different rows under the
same number (a non-deterministic repartition, a changed plan). So the marker stores what the
partition read:

* the batch **fingerprint** (a digest of ``offsets/N``: the source offset ranges of the batch);
* the partition's **content digest**: row count plus an order-independent sum of 64-bit row
  hashes, so the same rows in another order or other Arrow chunks give the same digest.

A replay computes both while it consumes its input (it always consumes it: upstream stateful
operators commit their state only when the input is drained) and skips only when they match;
otherwise it raises :class:`~onceflow.errors.ReplayMismatch` and writes nothing. The error
names the partitions of (lineage, batch) already committed, with their rows, and advises only
what cannot write them again: the same lineage with the same input, or a fork from a savepoint
taken at or after the batch (never one taken before it, which replays the whole batch).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from onceflow.errors import ReplayMismatch

_M = np.uint64((1 << 64) - 1)
_P = 0x100000001B3  # odd: invertible modulo 2**64
_P_INV = pow(_P, -1, 1 << 64)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, element-wise (uint64, wrapping)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _powers(base: int, n: int) -> np.ndarray:
    out = np.full(n, np.uint64(base), dtype=np.uint64)
    if n:
        out[0] = 1
    return np.cumprod(out, dtype=np.uint64)


def _bytes_hash(arr: pa.Array) -> np.ndarray:
    """Polynomial hash of each value of a (large) binary/string array, position-independent."""
    arr = arr.cast(pa.large_binary())
    n = len(arr)
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int64, count=n + 1, offset=arr.offset * 8)
    lo, hi = int(offsets[0]), int(offsets[-1])
    data = arr.buffers()[2]
    raw = (np.frombuffer(data, dtype=np.uint8, count=hi - lo, offset=lo).astype(np.uint64)
           if data is not None and hi > lo else np.zeros(0, dtype=np.uint64))
    prefix = np.zeros(len(raw) + 1, dtype=np.uint64)
    np.cumsum((raw + np.uint64(1)) * _powers(_P, len(raw)), dtype=np.uint64, out=prefix[1:])
    starts, ends = offsets[:-1] - lo, offsets[1:] - lo
    h = (prefix[ends] - prefix[starts]) * _powers(_P_INV, len(raw) + 1)[starts]
    return _mix(h ^ (ends - starts).astype(np.uint64))


def _column_hash(arr: pa.Array) -> np.ndarray:
    t = arr.type
    if pa.types.is_dictionary(t):
        return _column_hash(arr.dictionary_decode())
    if pa.types.is_boolean(t) or pa.types.is_integer(t):
        values = arr.cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False).view(np.uint64)
    elif pa.types.is_floating(t):
        values = arr.cast(pa.float64()).fill_null(0).to_numpy(zero_copy_only=False).view(np.uint64)
    elif pa.types.is_temporal(t):
        values = pc.cast(arr, pa.int64()).fill_null(0).to_numpy(zero_copy_only=False).view(np.uint64)
    elif pa.types.is_binary(t) or pa.types.is_string(t) or pa.types.is_large_binary(t) \
            or pa.types.is_large_string(t):
        values = _bytes_hash(arr)
    elif pa.types.is_decimal(t):
        values = _bytes_hash(pc.cast(arr, pa.string()))
    else:  # nested values (rare in sinks): their Python repr
        values = _bytes_hash(pa.array([repr(v) for v in arr.to_pylist()], pa.large_string()))
    valid = (np.ones(len(arr), dtype=bool) if arr.null_count == 0
             else arr.is_valid().to_numpy(zero_copy_only=False))
    return _mix(values + np.uint64(1)) * valid.astype(np.uint64)


class ContentDigest:
    """Order- and chunking-independent digest of the rows seen: ``"<rows>:<16 hex digits>"``."""

    def __init__(self) -> None:
        self.rows = 0
        self._sum = 0

    def update(self, batch: pa.RecordBatch) -> None:
        if not batch.num_rows:
            return
        with np.errstate(over="ignore"):
            row = np.zeros(batch.num_rows, dtype=np.uint64)
            for i, col in enumerate(batch.columns):
                row = _mix(row * np.uint64(_P) + _column_hash(col) + np.uint64(i))
            self._sum = (self._sum + int(row.sum(dtype=np.uint64))) & int(_M)
        self.rows += batch.num_rows

    def hexdigest(self) -> str:
        return f"{self.rows}:{self._sum:016x}"

    def feed(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """Passes ``batches`` through, digesting each."""
        for batch in batches:
            self.update(batch)
            yield batch


def task_fingerprint(checkpoint: str | None, batch_id: int) -> str:
    """Batch N's fingerprint from ``offsets/N`` (tasks read the shared checkpoint), or 'unknown'."""
    if not checkpoint:
        return "unknown"
    try:
        from onceflow.checkpoint.layout import CheckpointDir

        return CheckpointDir(checkpoint).offsets(batch_id).fingerprint
    except Exception:  # noqa: BLE001 - executors without access to the checkpoint
        return "unknown"


def committed_partitions(batch: int, lineage: str, parts: Mapping[int, int | None], *,
                         staged: bool = False) -> str:
    """``"partition(s) 0, 2 of batch 5 of lineage L (1200 rows) are already visible"``."""
    names = ", ".join(str(p) for p in sorted(parts)) or "none"
    counts = [r for r in parts.values() if r is not None]
    rows = f"{sum(counts)} rows" + (" or more" if len(counts) < len(parts) else "")
    what = ("staged (merged into the table only once the batch is decided)" if staged
            else "already visible")
    return f"partition(s) {names} of batch {batch} of lineage {lineage} ({rows}) are {what}"


def replay_advice(batch: int, *, staged: bool = False) -> str:
    """What to do after a ReplayMismatch without duplicating the partitions already committed."""
    harm = ("leaves their staged rows behind under the old lineage for good" if staged
            else "writes their rows a second time")
    return (
        f"To finish batch {batch} without duplicating them: give the job back what batch {batch} "
        f"read (the checkpoint's offsets/{batch} as committed, and a deterministic transform: no "
        "repartition() without keys, rand(), uuid() or current time) and restart the SAME lineage "
        "(onceflow run without --from-savepoint/--fork): the replay then skips them. Or fork from a "
        f"savepoint taken at or after batch {batch}, once batch {batch} is fully committed. Do NOT "
        f"fork or restore from a savepoint taken before batch {batch}: that replays all of batch "
        f"{batch} under a new lineage and {harm}")


def check_replay(where: str, batch: int, partition: int, lineage: str, *, stored_fingerprint: str | None,
                 fingerprint: str, stored_digest: str | None, digest: str,
                 committed: Mapping[int, int | None] | None = None, staged: bool = False) -> None:
    """Raise :class:`ReplayMismatch` unless the replay read what the committed attempt read.

    ``committed``: the partitions of (lineage, batch) the sink already holds committed, with
    their row counts (None: unknown); the error names them and gives advice that cannot
    duplicate them (``staged``: upsert rows not visible before the decision). A marker written
    before digests existed (``None``) is trusted; 'unknown' fingerprints (an executor that
    cannot read the checkpoint) are compared by content alone."""
    parts = dict(committed or {})
    parts.setdefault(partition, None)
    known = stored_fingerprint not in (None, "unknown") and fingerprint != "unknown"
    if known and stored_fingerprint != fingerprint:
        raise ReplayMismatch(
            f"{where}: batch {batch} partition {partition} of lineage {lineage} was already committed "
            f"from different source offsets (stored fingerprint {stored_fingerprint}, this run "
            f"{fingerprint}); nothing was written. The checkpoint was restored from an older "
            "savepoint or edited while keeping the lineage. "
            f"{committed_partitions(batch, lineage, parts, staged=staged)}. "
            f"{replay_advice(batch, staged=staged)}.")
    if stored_digest is not None and stored_digest != digest:
        raise ReplayMismatch(
            f"{where}: the replay of batch {batch} partition {partition} (lineage {lineage}) read "
            f"other rows (rows:digest {digest}) than the attempt that committed it ({stored_digest}); "
            "skipping it could lose or duplicate rows, so nothing was written. The job's output is "
            "not deterministic for the same input. "
            f"{committed_partitions(batch, lineage, parts, staged=staged)}. "
            f"{replay_advice(batch, staged=staged)}.")
