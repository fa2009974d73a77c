"""Shard-level reading shared by the driver (planning) and the executors (reading ranges).

Kinesis sequence numbers are increasing within a shard but not dense, so the end of a
micro-batch is the sequence number of a record that exists when the batch is planned; a
replay reads exactly the records after the start position up to and including it.
"""

from __future__ import annotations

import logging
import time  # noqa: F401
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from onceflow.errors import SourceError
from onceflow.sources.kinesis.client import call, client, error_code, one_line
from onceflow.sources.kinesis.options import (
    AT_SEQ,
    NAME,
    SHARD_END,
    TRIM_HORIZON,
    KinesisDataLossError,
    Settings,
    is_seq,
)

log = logging.getLogger("onceflow.sources.kinesis")

#: GetRecords' maximum Limit.
MAX_LIMIT = 10_000


@dataclass(frozen=True)
class ShardInfo:
    """One shard as ListShards reports it."""

    stream: str
    shard_id: str
    parents: tuple[str, ...]
    closed: bool

    @classmethod
    def of(cls, stream: str, raw: dict) -> ShardInfo:
        parents = tuple(p for p in (raw.get("ParentShardId"), raw.get("AdjacentParentShardId")) if p)
        return cls(stream, raw["ShardId"], parents,
                   "EndingSequenceNumber" in raw.get("SequenceNumberRange", {}))


class StalePosition(Exception):
    """GetShardIterator refused a checkpointed sequence number (not from this stream)."""


def iterator(s: Settings, stream: str, shard: str, position: str, timestamp: float | None = None) -> str | None:
    """A shard iterator at ``position`` (see options: a sequence number reads after it)."""
    from botocore.exceptions import ClientError

    kwargs: dict[str, Any] = {"StreamName": stream, "ShardId": shard}
    if timestamp is not None:
        kwargs.update(ShardIteratorType="AT_TIMESTAMP", Timestamp=timestamp)
    elif is_seq(position):
        kwargs.update(ShardIteratorType="AFTER_SEQUENCE_NUMBER", StartingSequenceNumber=position)
    elif position.startswith(AT_SEQ):
        kwargs.update(ShardIteratorType="AT_SEQUENCE_NUMBER", StartingSequenceNumber=position[len(AT_SEQ):])
    else:
        kwargs.update(ShardIteratorType=position)  # TRIM_HORIZON / LATEST
    try:
        return call(s, f"GetShardIterator({stream}/{shard})", client(s).get_shard_iterator,
                    **kwargs)["ShardIterator"]
    except ClientError as e:
        if error_code(e) == "InvalidArgumentException" and "Timestamp" not in kwargs:
            raise StalePosition(one_line(e)) from None
        if error_code(e) == "InvalidArgumentException":
            return None  # a timestamp the service refuses (clock skew): treated as "no records"
        if error_code(e) == "ResourceNotFoundException":
            raise StalePosition(one_line(e)) from None
        raise SourceError(f"{NAME}: GetShardIterator on {stream}/{shard}: {one_line(e)}") from None


def responses(s: Settings, stream: str, shard: str, position: str, limit: int = MAX_LIMIT,
              timestamp: float | None = None, closed: bool = False) -> Iterator[dict]:
    """GetRecords responses from ``position`` on; stops after an empty response at the tip
    (``MillisBehindLatest`` 0) of an open shard, or at the end of a ``closed`` shard
    (``NextShardIterator`` None; empty responses before it are followed, up to 100 in a row).
    An expired iterator is renewed after the last record seen."""
    from botocore.exceptions import ClientError

    it = iterator(s, stream, shard, position, timestamp)
    last = position
    c = client(s)
    empty = 0
    while it:
        try:
            out = call(s, f"GetRecords({stream}/{shard})", c.get_records, ShardIterator=it, Limit=limit)
        except ClientError as e:
            if error_code(e) == "ExpiredIteratorException":
                it = iterator(s, stream, shard, last)
                continue
            raise SourceError(f"{NAME}: GetRecords on {stream}/{shard}: {one_line(e)}") from None
        records = out.get("Records", [])
        if records:
            last = records[-1]["SequenceNumber"]
        it = out.get("NextShardIterator")
        yield out
        empty = 0 if records else empty + 1
        at_tip = not records and out.get("MillisBehindLatest", 0) == 0
        if it is None or (at_tip and (not closed or empty >= 100)):
            return


def read_ahead(s: Settings, stream: str, shard: str, position: str, cap: int | None,
               closed: bool = False, on_records: Callable[[list], None] | None = None
               ) -> tuple[str, int, bool, int]:
    """Driver: read from ``position`` up to ``cap`` records (all, when None). Returns the last
    sequence number read (``position`` when none), how many, whether a closed shard's end was
    reached, and how far behind the tip the read stopped in ms (0: at the tip; -1: behind, by
    an unknown amount: the cap left records of the last response unread). ``on_records``
    receives the records read, in order (see spill.py)."""
    last, n = position, 0
    keep = on_records or (lambda records: None)
    # with a cap, ask for one record more than it takes: a response that holds it shows that
    # the read stopped behind the tip (kinesalite's MillisBehindLatest is always 0)
    for out in responses(s, stream, shard, position, MAX_LIMIT if cap is None else min(MAX_LIMIT, cap + 1),
                         closed=closed):
        records = out.get("Records", [])
        behind = int(out.get("MillisBehindLatest") or 0)
        if cap is not None and n + len(records) >= cap:
            more = n + len(records) > cap
            records = records[: cap - n]
            keep(records)
            if records:
                last, n = records[-1]["SequenceNumber"], cap
            return last, n, False, behind or (-1 if more else 0)
        keep(records)
        if records:
            last, n = records[-1]["SequenceNumber"], n + len(records)
        if out.get("NextShardIterator") is None:
            return last, n, True, 0
    return last, n, False, 0


def tail(s: Settings, stream: str, shard: str, position: str) -> str:
    """Driver: the sequence number of the newest record of a shard after ``position``
    (``position`` when there is none). Kinesis has no call that returns a shard's last
    sequence number, so this reads every record after ``position`` (and discards them)."""
    return read_ahead(s, stream, shard, position, None)[0]


def initial_position(s: Settings, info: ShardInfo, spec: str, timestamp: float | None) -> str:
    """Resolve a starting spec for one shard into a replayable position (pinned now)."""
    if spec == TRIM_HORIZON or is_seq(spec):
        return spec
    if info.closed and spec == "LATEST":
        return SHARD_END
    if spec == "LATEST":
        newest = tail(s, info.stream, info.shard_id, TRIM_HORIZON)
        return newest  # TRIM_HORIZON when the shard holds no record yet
    # AT_TIMESTAMP: just before the first record at/after the timestamp, else after the newest.
    for out in responses(s, info.stream, info.shard_id, TRIM_HORIZON, limit=1, timestamp=timestamp):
        if out.get("Records"):
            return AT_SEQ + out["Records"][0]["SequenceNumber"]
    if info.closed:
        return SHARD_END
    return tail(s, info.stream, info.shard_id, TRIM_HORIZON)


def first_available(s: Settings, stream: str, shard: str) -> str | None:
    """Sequence number of the oldest record the shard still keeps (None: none)."""
    for out in responses(s, stream, shard, TRIM_HORIZON, limit=1):
        if out.get("Records"):
            return out["Records"][0]["SequenceNumber"]
    return None


def check_retained(s: Settings, stream: str, shard: str, position: str) -> str | None:
    """None when reading can continue at ``position``; else why records after it may be lost
    (the checkpointed record was trimmed by retention, or the stream was re-created)."""
    if not is_seq(position) and not position.startswith(AT_SEQ):
        return None
    seq = position[len(AT_SEQ):] if position.startswith(AT_SEQ) else position
    try:
        for out in responses(s, stream, shard, AT_SEQ + seq, limit=1):
            recs = out.get("Records")
            if recs:
                if recs[0]["SequenceNumber"] == seq:
                    return None
                break
    except StalePosition as e:
        return f"the checkpointed sequence number {seq} is not in the shard ({e}; stream re-created?)"
    oldest = first_available(s, stream, shard)
    if oldest is None or int(oldest) <= int(seq):
        return None  # nothing trimmed past the position
    return (f"the checkpointed record {seq} was trimmed (retention); the shard now starts at "
            f"{oldest}, records between them are lost")


def raise_or_skip(s: Settings, stream: str, shard: str, position: str, why: str) -> None:
    """failOnDataLoss: raise; else log (the caller counts it in the event log)."""
    msg = f"stream {stream} shard {shard} at {position}: {why}"
    if s.fail_on_data_loss:
        raise KinesisDataLossError(f"{NAME}: {msg}. Restore from a savepoint, or set "
                                   "failOnDataLoss=false to skip them")
    log.warning("%s: %s; failOnDataLoss=false: continuing at the shard's trim horizon", NAME, msg)


def accepted_losses(s: Settings) -> set[tuple[str, str]]:
    """(stream, shard) of every reshard loss that ``eventLog`` says was accepted
    (``source_data_loss`` with ``failed`` false): a shard reported once is not reported again,
    even after ``failOnDataLoss`` is set back to true. Reads the whole event log: called only
    when a loss is found."""
    if not s.event_log:
        return set()
    from onceflow.checkpoint.eventlog import EventLog

    try:
        return {(e["stream"], e["shard"]) for e in EventLog(s.event_log).read()
                if e.get("event") == "source_data_loss" and e.get("failed") is False
                and str(e.get("cause", "")).startswith("reshard:") and e.get("source") == NAME}
    except (OSError, KeyError) as e:
        log.warning("%s: could not read the event log for accepted losses: %s", NAME, e)
        return set()


def record_event(s: Settings, event: str, **fields: Any) -> None:
    """Append an event to the job's event log (``eventLog``); never fails the query."""
    if not s.event_log:
        return
    from onceflow.checkpoint.eventlog import EventLog

    try:
        EventLog(s.event_log).append(event, source=NAME, **fields)
    except OSError as e:
        log.warning("%s: could not record %s in the event log: %s", NAME, event, e)
