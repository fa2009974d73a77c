"""Executor side of the Kinesis source: reading one shard range into Arrow batches."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import closing

import pyarrow as pa
from pyspark.sql.datasource import InputPartition
from pyspark.sql.types import StructType

from onceflow.errors import SourceError
from onceflow.sources.kinesis.client import THROTTLED
from onceflow.sources.kinesis.options import NAME, SHARD_END, TRIM_HORIZON, Settings
from onceflow.sources.kinesis.shards import (
    StalePosition,
    raise_or_skip,
    record_event,
    responses,
)
from onceflow.sources.kinesis.spill import read_spill, to_arrow
from onceflow.sources.prefetch import prefetched

log = logging.getLogger("onceflow.sources.kinesis")


class KinesisInputPartition(InputPartition):
    """One shard's records after ``start`` up to and including ``end`` (a sequence number, or
    ``SHARD_END``: to the end of the closed shard) for one micro-batch."""

    def __init__(self, stream: str, shard: str, start: str, end: str) -> None:
        super().__init__((stream, shard, start, end))
        self.stream, self.shard, self.start, self.end = stream, shard, start, end


def read_range(s: Settings, schema: StructType, part: KinesisInputPartition) -> Iterator[pa.RecordBatch]:
    """Yield the range's records as Arrow batches of ``schema`` (one per GetRecords response).

    Stops at the record whose sequence number is ``end`` (or at the end of a closed shard).
    Fails when no progress is made within ``pollTimeoutMs`` (the planned records must exist).
    A background thread issues the next GetRecords while this one builds Arrow batches."""
    from pyspark.sql.pandas.types import to_arrow_schema

    arrow_schema = to_arrow_schema(schema, timezone="UTC")
    spilled = read_spill(s, part.stream, part.shard, part.start, part.end, arrow_schema)
    if spilled is not None:  # the driver read this range while planning it
        yield from spilled
        return
    throttled_before = THROTTLED.value
    ahead = prefetched(lambda done: _fetch(s, part, done), f"onceflow-kinesis-{part.shard}")
    try:
        with closing(ahead):
            for records in ahead:
                yield to_arrow(records, part.stream, part.shard, arrow_schema)
    finally:
        throttled = THROTTLED.value - throttled_before
        if throttled:
            record_event(s, "source_throttled", where="task", stream=part.stream, shard=part.shard,
                         requests=throttled)


def _fetch(s: Settings, part: KinesisInputPartition, done: threading.Event) -> Iterator[list]:
    start, end = part.start, part.end
    stop_at = None if end == SHARD_END else int(end)
    deadline = time.monotonic() + s.poll_timeout_ms / 1000
    position = start
    while not done.is_set():
        try:
            for out in responses(s, part.stream, part.shard, position, closed=stop_at is None):
                records = out.get("Records", [])
                if records:
                    deadline = time.monotonic() + s.poll_timeout_ms / 1000
                    position = records[-1]["SequenceNumber"]
                    if stop_at is not None and int(position) >= stop_at:
                        yield [r for r in records if int(r["SequenceNumber"]) <= stop_at]
                        return
                    yield records
                if out.get("NextShardIterator") is None:
                    if stop_at is not None:
                        raise SourceError(f"{NAME}: {part.stream}/{part.shard} ended before record {end} "
                                          f"while reading after {start}; was the stream re-created?")
                    return
        except StalePosition as e:
            why = f"the checkpointed sequence number is not in the shard ({e}; stream re-created?)"
            record_event(s, "source_data_loss", stream=part.stream, shard=part.shard, start=position,
                         end=end, records=None, cause=why, failed=s.fail_on_data_loss)
            raise_or_skip(s, part.stream, part.shard, position, why)
            position = TRIM_HORIZON
            continue
        if time.monotonic() > deadline:
            raise SourceError(f"{NAME}: {part.stream}/{part.shard}: record {end} did not arrive within "
                              f"{s.poll_timeout_ms} ms while reading after {start}; is Kinesis reachable? "
                              "raise pollTimeoutMs if it is just slow")
        time.sleep(0.2)  # at the tip before the planned end (an empty answer): ask again
