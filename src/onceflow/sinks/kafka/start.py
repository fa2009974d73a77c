"""Where a lineage's marker reading starts, kept in the job's checkpoint.

The marker topic only grows: it is compacted, and every marker has a key of its own. Without
a start, every new process (a driver, a Python worker on an executor) read the whole marker
partition, every lineage and every batch since the topic was created: about 10 µs and 1.9 KB
per marker, so after a week at 1M markers a day a new worker needed minutes and gigabytes.

After each batch it decides, the driver computes the lineage's *horizon* for that batch
(:meth:`MarkerLog.horizon`): the offset at or before every marker of that batch and of later
ones, not past its read position, and the highest epoch taken before that offset. Once the
horizon has moved ``marker_start_step`` offsets past the recorded one, it writes it to
``<checkpoint>/_onceflow/sink-cache/kafka-markers-<sink_id>.json`` (one small write; a
failure is logged and changes nothing). A new reader of the lineage starts there, with that
epoch, and knows every batch before the recorded one is decided: a late task attempt of such
a batch (an executor that woke after its batch was decided and the job moved on) writes
nothing. A restore clears ``_onceflow/sink-cache/`` (a resume from an older savepoint must not
start after the batches it replays), and restore checks read from offset 0.

Guarantee: what a reader needs is never before the start. A batch that may still be replayed
is the one just decided or a later one (Spark wrote ``commits/N-1`` before batch N started),
and its markers, a zombie's included, are at or after the horizon; a transaction still open
when the horizon was taken commits records at offsets after it. Decisions after the start are
judged against every epoch taken before them (the recorded epoch covers those before the
start). A record of another lineage, topic or partition, an unreadable file, or a start past
the log's end (the topic was re-created) means reading from offset 0, as before.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from onceflow.checkpoint.layout import SINK_CACHE, CheckpointDir
from onceflow.storage import write_whole

if TYPE_CHECKING:
    from onceflow.sinks.kafka.markers import MarkerLog

log = logging.getLogger("onceflow.sinks.kafka")

#: offsets the horizon must move before the driver records it again (option marker_start_step)
DEFAULT_STEP = 1000


def _path(ckpt: CheckpointDir, sink_id: str) -> str:
    return f"{ckpt.path}/{SINK_CACHE}/kafka-markers-{sink_id}.json"


def read_start(checkpoint: str | None, sink_id: str, lineage: str, topic: str,
               partition: int) -> tuple[int, int | None, int]:
    """(offset, epoch before it, the batch it was recorded after: every earlier batch is
    decided) for the lineage, else (0, None, 0): read everything."""
    if not checkpoint:
        return 0, None, 0
    try:
        ckpt = CheckpointDir(checkpoint)
        rec: dict[str, Any] = json.loads(ckpt.fs.cat_file(_path(ckpt, sink_id)))
    except FileNotFoundError:
        return 0, None, 0
    except Exception as e:  # noqa: BLE001 - any storage or format error: read from the beginning
        log.warning("cannot read the marker start of sink %s in %s (%s); reading its markers from "
                    "the beginning", sink_id, checkpoint, e)
        return 0, None, 0
    if (rec.get("lineage"), rec.get("topic"), rec.get("partition")) != (lineage, topic, partition):
        return 0, None, 0
    start, epoch, batch = rec.get("start"), rec.get("epoch"), rec.get("batch")
    if not (isinstance(start, int) and start >= 0 and isinstance(batch, int) and batch >= 0
            and (epoch is None or isinstance(epoch, int))):
        return 0, None, 0
    return start, epoch, batch


def write_start(checkpoint: str, sink_id: str, lineage: str, topic: str, partition: int,
                batch: int, start: int, epoch: int) -> bool:
    """Record the lineage's start (after ``batch`` was decided); False (logged) when it could
    not be written: readers then start from the previous one."""
    rec = {"format": 1, "sink": sink_id, "lineage": lineage, "topic": topic, "partition": partition,
           "batch": batch, "start": start, "epoch": epoch}
    try:
        ckpt = CheckpointDir(checkpoint)
        ckpt.fs.makedirs(f"{ckpt.path}/{SINK_CACHE}", exist_ok=True)
        write_whole(ckpt.fs, _path(ckpt, sink_id), json.dumps(rec).encode())
        return True
    except Exception as e:  # noqa: BLE001 - the start only saves reading; never fail a batch on it
        log.warning("cannot record the marker start of sink %s in %s (%s); new readers start from "
                    "the previous one", sink_id, checkpoint, e)
        return False


def advance_start(markers: MarkerLog, checkpoint: str, batch: int, step: int) -> None:
    """After ``batch`` was decided: record the lineage's horizon once it moved ``step``
    offsets past the recorded start."""
    start, epoch = markers.horizon(batch)
    if start - markers.recorded >= step and write_start(
            checkpoint, markers.sink, markers.lineage, markers.topic, markers.partition, batch, start, epoch):
        markers.recorded = start
