"""Checkpoint history for ``onceflow checkpoints``: recent batches from the event log and
Spark's ``offsets/`` and ``commits/`` directories.

The event log gives each batch's progress (``batch`` events: time, duration, input rows,
offsets, state rows and bytes) and sink commit (``sink_commit``: commit seconds, replay);
Spark's directories say which batches are planned and committed (and carry the offsets of
batches the event log does not know, e.g. after a restore).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from onceflow.checkpoint.eventlog import EventLog
from onceflow.checkpoint.layout import CheckpointDir


@dataclass
class BatchRecord:
    batch: int
    status: str  # committed | planned (offsets written, no commit yet)
    time: float | None = None
    duration_ms: int | None = None
    input_rows: int | None = None
    offsets: list = field(default_factory=list)
    state_rows: int | None = None
    state_bytes: int | None = None
    sink_commit_s: float | None = None
    sink_rows: int | None = None
    replays: int = 0  # sink commits of this batch that found it already decided

    def to_dict(self) -> dict:
        return asdict(self)


def batch_history(checkpoint_url: str, limit: int | None = 20) -> list[BatchRecord]:
    """The last ``limit`` batches (all with None), oldest first."""
    ckpt = CheckpointDir(checkpoint_url)
    records: dict[int, BatchRecord] = {}
    committed = set(ckpt.committed_batches())
    for b in ckpt.offset_batches():
        records[b] = BatchRecord(b, "committed" if b in committed else "planned")
    lineage = ckpt.lineage if ckpt.exists() else None
    for e in EventLog(ckpt.url).read():
        kind, b = e.get("event"), e.get("batch")
        if not isinstance(b, int):
            continue
        rec = records.setdefault(b, BatchRecord(b, "committed (purged)" if kind == "batch" else "unknown"))
        if kind == "batch":  # the latest run of the batch wins
            rec.time, rec.duration_ms, rec.input_rows = e.get("ts"), e.get("duration_ms"), e.get("input_rows")
            rec.offsets = e.get("offsets") or rec.offsets
            rec.state_rows, rec.state_bytes = e.get("state_rows"), e.get("state_bytes")
        elif kind == "sink_commit" and (lineage is None or e.get("lineage") in (None, lineage)):
            if e.get("replay"):
                rec.replays += 1
            else:
                rec.sink_commit_s, rec.sink_rows = e.get("commit_s"), e.get("rows")
    for b, rec in records.items():
        if not rec.offsets and b in committed | set(ckpt.offset_batches()):
            try:
                rec.offsets = ckpt.source_offsets(b)
            except Exception:  # noqa: BLE001 - a damaged offsets file shows as no offsets
                rec.offsets = []
    ordered = [records[b] for b in sorted(records)]
    return ordered[-limit:] if limit else ordered
