"""Executor side of the Kafka source: reading one offset range into Arrow batches."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import closing

import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import InputPartition
from pyspark.sql.types import (
    StructType,
)

from onceflow.errors import OnceflowError, SourceError
from onceflow.sources.kafka.options import (
    NAME,
    KafkaDataLossError,
    Settings,
)
from onceflow.sources.prefetch import prefetched

log = logging.getLogger("onceflow.sources.kafka")


class KafkaInputPartition(InputPartition):
    """One Kafka partition's offset range ``[start, end)`` for one micro-batch."""

    def __init__(self, topic: str, partition: int, start: int, end: int) -> None:
        super().__init__((topic, partition, start, end))
        self.topic, self.partition, self.start, self.end = topic, partition, start, end


def read_range(settings: Settings, schema: StructType,
               part: KafkaInputPartition, batch_rows: int = 10_000) -> Iterator[pa.RecordBatch]:
    """Yield the records of ``[part.start, part.end)`` as Arrow batches of ``schema``.

    Stops when the consumer's position reaches ``end`` (control records included), not after a
    number of messages. Fails when offsets below ``end`` disappear, or when no progress is made
    within ``pollTimeoutMs``. A background thread fetches the next records while this one
    builds Arrow batches (``consume`` releases the GIL); its errors are raised here.
    """
    from pyspark.sql.pandas.types import to_arrow_schema

    arrow_schema = to_arrow_schema(schema, timezone="UTC")
    ahead = prefetched(lambda done: _fetch(settings, part, batch_rows, done),
                       f"onceflow-kafka-{part.topic}-{part.partition}")
    with closing(ahead):
        for msgs in ahead:
            yield _batch(msgs, part.topic, part.partition, arrow_schema)


def _fetch(settings: Settings, part: KafkaInputPartition, batch_rows: int,
           done: threading.Event) -> Iterator[list]:
    """Lists of the range's records (up to ``batch_rows`` each); see :func:`read_range`."""
    from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

    read_fatal = _read_fatal_codes()
    t, p, end = part.topic, part.partition, part.end
    consumer = Consumer({
        **READER_DEFAULTS, **settings.consumer_conf,
        "group.id": f"onceflow-reader-{uuid.uuid4().hex[:8]}",
        "enable.auto.commit": False, "enable.auto.offset.store": False,
        "auto.offset.reset": "error", "enable.partition.eof": False,
    })
    msgs: list = []  # records of the batch being built; columns are made in one pass each
    pos = part.start
    try:
        consumer.assign([TopicPartition(t, p, pos)])
        deadline = time.monotonic() + settings.poll_timeout_ms / 1000
        while pos < end and not done.is_set():
            before = pos
            chunk = consumer.consume(num_messages=min(batch_rows, end - pos), timeout=1.0)
            if chunk and not any(map(Message.error, chunk)) and chunk[0].offset() >= pos \
                    and chunk[-1].offset() < end:  # the common case, without a per-record loop
                msgs.extend(chunk)
                pos = chunk[-1].offset() + 1
                chunk = []
            for m in chunk:
                err = m.error()
                if err is not None:
                    if err.code() in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE):
                        pos = _skip_deleted(consumer, settings, part, pos)
                        break
                    if err.fatal() or err.code() in read_fatal:
                        raise OnceflowError(f"{NAME}: reading topic {t} partition {p}: {err.str()}")
                    log.warning("%s: topic %s partition %d: %s (retrying)", NAME, t, p, err.str())
                    continue
                off = m.offset()
                if off < pos:
                    continue
                if off >= end:
                    pos = end
                    break
                msgs.append(m)
                pos = off + 1
            if pos < end:  # control records / aborted data: the position moves past them
                position = consumer.position([TopicPartition(t, p)])[0].offset
                if position is not None and position > pos:
                    pos = min(position, end)
            if len(msgs) >= batch_rows:
                yield msgs
                msgs = []
            if pos > before:
                deadline = time.monotonic() + settings.poll_timeout_ms / 1000
            elif time.monotonic() > deadline:
                raise SourceError(
                    f"{NAME}: topic {t} partition {p}: no record at offset {pos} within "
                    f"{settings.poll_timeout_ms} ms while reading [{part.start}, {end}); "
                    "is the broker reachable? raise pollTimeoutMs if it is just slow")
        if msgs:
            yield msgs
    finally:
        consumer.close()


def _skip_deleted(consumer, settings: Settings, part: KafkaInputPartition, pos: int) -> int:
    """Offset ``pos`` was deleted after planning: fail, or (failOnDataLoss=false) log the lost
    range and continue at the new start of the log; returns the new position."""
    from confluent_kafka import TopicPartition

    t, p = part.topic, part.partition
    low, _ = consumer.get_watermark_offsets(TopicPartition(t, p),
                                            timeout=settings.metadata_timeout_ms / 1000)
    msg = (f"topic {t} partition {p}: offsets [{pos}, {low}) were deleted while reading "
           f"[{part.start}, {part.end})")
    if settings.fail_on_data_loss or low <= pos:
        raise KafkaDataLossError(f"{NAME}: {msg}. Restore from a savepoint, or set "
                                 "failOnDataLoss=false to skip them")
    new_pos = min(low, part.end)
    log.warning("%s: %s; skipped %d records (failOnDataLoss=false)", NAME, msg, new_pos - pos)
    record_data_loss(settings, t, p, pos, new_pos, new_pos - pos, "deleted while reading")
    consumer.assign([TopicPartition(t, p, new_pos)])
    return new_pos


def record_data_loss(settings: Settings, topic: str, partition: int, start: int, end: int,
                     records: int | None, cause: str, total: int | None = None) -> None:
    """Count skipped records (failOnDataLoss=false) in the job's event log as ``source_data_loss``
    (``records`` None: unknown, the log was re-created). A replanned batch may report a range
    again after a restart. Never fails the query: the WARNING log line is always written."""
    if not settings.event_log:
        return
    from onceflow.checkpoint.eventlog import EventLog

    try:
        EventLog(settings.event_log).append(
            "source_data_loss", source=NAME, topic=topic, partition=partition, start=start, end=end,
            records=records, cause=cause, **({"skipped_so_far": total} if total is not None else {}))
    except OSError as e:
        log.warning("%s: could not record data loss in the event log: %s", NAME, e)


# Executor reads fetch in large chunks (users may override them with kafka.* options).
READER_DEFAULTS = {"fetch.max.bytes": 52_428_800, "max.partition.fetch.bytes": 10_485_760}


def _read_fatal_codes() -> set[int]:
    from confluent_kafka import KafkaError

    return {KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.UNKNOWN_TOPIC_OR_PART,
            KafkaError._UNKNOWN_PARTITION, KafkaError._UNKNOWN_TOPIC}


def _batch(msgs: list, topic: str, partition: int, schema: pa.Schema) -> pa.RecordBatch:
    """Records of one topic partition -> an Arrow batch in Spark's Kafka source schema.

    Each column is built in one C-level pass (``map`` over the Message methods, numpy), so the
    per-record Python work stays small next to the consumer's own."""
    from confluent_kafka import Message

    n = len(msgs)
    # confluent-kafka timestamps: (type, ms) with type 0 none, 1 create, 2 log-append;
    # Spark/Java's timestampType is -1, 0, 1.
    stamps = np.array(list(map(Message.timestamp, msgs)), dtype=np.int64).reshape(n, 2)
    kinds = stamps[:, 0]
    arrays = []
    for f in schema:
        if f.name == "key":
            arrays.append(pa.array(list(map(Message.key, msgs)), f.type))
        elif f.name == "value":
            arrays.append(pa.array(list(map(Message.value, msgs)), f.type))
        elif f.name == "topic":
            arrays.append(pa.repeat(pa.scalar(topic, f.type), n))
        elif f.name == "partition":
            arrays.append(pa.array(np.full(n, partition, dtype=np.int32), f.type))
        elif f.name == "offset":
            arrays.append(pa.array(np.fromiter(map(Message.offset, msgs), np.int64, n), f.type))
        elif f.name == "timestamp":  # microseconds, null without a timestamp
            arrays.append(pa.array(stamps[:, 1] * 1000, pa.int64(), mask=kinds == 0).cast(f.type))
        elif f.name == "timestampType":
            arrays.append(pa.array((kinds - 1).astype(np.int32), f.type))
        elif f.name == "headers":
            headers = list(map(Message.headers, msgs))
            if any(headers):
                rows = [[{"key": k, "value": v} for k, v in h] if h else [] for h in headers]
                arrays.append(pa.array(rows, f.type))
            else:  # the common case: no record has headers -> n empty lists, built in C
                offsets = pa.array(np.zeros(n + 1, dtype=np.int32))
                arrays.append(pa.ListArray.from_arrays(offsets, pa.array([], f.type.value_type)))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


