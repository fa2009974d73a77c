"""The marker topic: what the Kafka sink knows about each (sink, lineage), as Kafka records.

Three kinds of JSON markers, all of one (sink, lineage) on one partition of the marker topic
(chosen by the hash of ``<sink_id>/<lineage>``), each with its own record key:

* ``partition`` (key ``<sink>/<lineage>/p/<batch>/<partition>``): produced last in the task's
  transaction; committed means that partition of that batch is visible.
* ``decision`` (key ``<sink>/<lineage>/d/<batch>/<epoch>``): the driver's decision for a
  batch, with its fingerprint, handles and the driver's epoch.
* ``epoch`` (key ``<sink>/<lineage>/e/<epoch>``): a driver incarnation took this epoch.

Guarantees:
- The topic is created with ``cleanup.policy=compact`` (never deleted by age) and replication
  ``min(3, brokers)``. Keys differ for every record recovery reads (each partition marker,
  each decision of each epoch, each epoch), so compaction only drops exact repeats and keeps
  the relative order of what it keeps: every rule below reads the same before and after it.
- :class:`MarkerLog` reads with ``read_committed``, in log order, up to the log end taken when
  a refresh starts. A decision counts only if no epoch marker with a higher epoch precedes it
  in the log (a fenced driver's late write is ignored; a decision without ``epoch``, from an
  older onceflow, counts as epoch 0). The first counting decision of a batch wins, and the
  first partition marker of a (batch, partition). Readers never look at record keys, so
  markers written by older versions (all keyed ``<sink>/<lineage>``) read the same.
- Aborted markers are invisible only on brokers that pass the probe (see probe.py).

What a process reads does not grow with the job's age or with other lineages (see start.py):
a :class:`MarkerLog` holds one (sink, lineage), starts at the lineage's recorded *start*
(the offset before which every marker the lineage may still need lies at or after, with the
highest epoch taken before it), skips other lineages' records by their key without parsing
them, and forgets markers of batches settled long ago.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from onceflow.errors import SinkError
from onceflow.kafka_client import admin_client, consumer_conf, error_text
from onceflow.sinks.kafka.common import FORMAT, ensure_topic, unreachable

log = logging.getLogger("onceflow.sinks.kafka")

#: Configuration of a marker topic onceflow creates.
MARKER_TOPIC_CONFIG = {"cleanup.policy": "compact"}


class MarkerWait(SinkError):
    """An open transaction holds the marker partition's read_committed position."""


def marker_partition(key: str, partitions: int) -> int:
    return zlib.crc32(key.encode()) % max(partitions, 1)


def routing_key(sink: str, lineage: str) -> str:
    """Chooses the marker partition of (sink, lineage); the key of markers before epochs."""
    return f"{sink}/{lineage}"


def partition_key(sink: str, lineage: str, batch: int, partition: int) -> str:
    return f"{sink}/{lineage}/p/{batch}/{partition}"


def decision_key(sink: str, lineage: str, batch: int, epoch: int | None) -> str:
    return f"{sink}/{lineage}/d/{batch}/{epoch}"


def epoch_key(sink: str, lineage: str, epoch: int) -> str:
    return f"{sink}/{lineage}/e/{epoch}"


_MARKER_PARTS: dict[tuple[str, str], int] = {}
_ENSURED: set[tuple[str, str]] = set()


def ensure_marker_topic(conf: Mapping[str, Any], topic: str, timeout: float) -> int:
    """Create the marker topic (compacted, replication min(3, brokers)) if it is missing, once
    per process; return its partition count."""
    key = (conf["bootstrap.servers"], topic)
    if key not in _ENSURED:
        _MARKER_PARTS[key] = ensure_topic(conf, topic, timeout, MARKER_TOPIC_CONFIG)
        _ENSURED.add(key)
    return _MARKER_PARTS[key]


def marker_partitions(conf: Mapping[str, Any], topic: str, timeout: float) -> int:
    """Partition count of the marker topic (cached); SinkError when it does not exist."""
    from confluent_kafka import KafkaException

    key = (conf["bootstrap.servers"], topic)
    if key not in _MARKER_PARTS:
        try:
            md = admin_client(conf).list_topics(topic, timeout=timeout).topics.get(topic)
        except KafkaException as e:
            raise unreachable(conf, timeout, e) from None
        if md is None or md.error is not None or not md.partitions:
            raise SinkError(f"{FORMAT}: marker topic {topic} does not exist on {conf['bootstrap.servers']}")
        _MARKER_PARTS[key] = len(md.partitions)
    return _MARKER_PARTS[key]


#: decided batches of a lineage whose markers a reader keeps below its latest decision
KEEP_BATCHES = 10


class MarkerLog:
    """What the marker topic says about one (sink, lineage), read with read_committed from the
    lineage's start and cached per process.

    :meth:`refresh` reads on from the last position until the consumer's position reaches the
    log end (uncommitted high watermark) taken when the refresh started: a read_committed
    consumer stops at the last stable offset, so this also waits for transactions open on the
    marker partition to finish (markers are produced last in a transaction, so that window is
    short). Aborted markers are invisible only on brokers that pass the probe.
    """

    _instances: ClassVar[dict[tuple, MarkerLog]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, conf: Mapping[str, Any], topic: str, partition: int, timeout: float,
                 sink: str, lineage: str, start: int = 0, base_epoch: int | None = None,
                 settled_below: int = 0):
        from confluent_kafka import Consumer, TopicPartition

        self.conf, self.topic, self.partition, self.timeout = dict(conf), topic, partition, timeout
        self.sink, self.lineage = sink, lineage
        self._key = routing_key(sink, lineage).encode()
        self.tp = TopicPartition(topic, partition)
        self.parts: dict[tuple[str, str, int, int], dict] = {}
        self.decisions: dict[tuple[str, str, int], dict] = {}
        #: (sink, lineage) -> highest epoch taken so far (before ``start``: ``base_epoch``)
        self.epochs: dict[tuple[str, str], int] = {(sink, lineage): base_epoch} if base_epoch else {}
        #: decisions written after a higher epoch had opened (fenced drivers' late writes)
        self.ignored: dict[tuple[str, str, int], list[dict]] = {}
        self.start, self.base_epoch = start, base_epoch or 0
        #: the start last recorded in the checkpoint (the driver records a newer one, start.py)
        self.recorded = start
        #: offsets of the epoch markers read, and of the first marker read of each batch
        self.epoch_offsets: list[tuple[int, int]] = []
        self.first_offsets: dict[int, int] = {}
        self.records_read = self.records_kept = 0
        #: every batch below this one is decided (its markers may be forgotten or before
        #: ``start``): a late task attempt of such a batch must write nothing
        self.settled_below = settled_below
        self.pos = start
        base = {**consumer_conf(conf), "enable.auto.commit": False, "enable.partition.eof": False,
                "auto.offset.reset": "earliest"}
        self.consumer = Consumer({**base, "group.id": f"onceflow-markers-{uuid.uuid4().hex[:8]}",
                                  "isolation.level": "read_committed"})
        self.consumer.assign([TopicPartition(topic, partition, start)])
        self.watermarks = Consumer({**base, "group.id": f"onceflow-markers-wm-{uuid.uuid4().hex[:8]}",
                                    "isolation.level": "read_uncommitted"})
        self.lock = threading.Lock()

    @classmethod
    def get(cls, conf: Mapping[str, Any], topic: str, partition: int, timeout: float, sink: str,
            lineage: str, origin: Callable[[], tuple[int, int | None, int]] | None = None) -> MarkerLog:
        """This process's reader of (sink, lineage); a new one starts where ``origin()`` says
        (offset, highest epoch before it, the batch below which every batch is decided), or
        at offset 0 without ``origin`` (a reader of its own: it sees every marker)."""
        key = (conf["bootstrap.servers"], topic, partition, sink, lineage, origin is None)
        with cls._lock:
            if key not in cls._instances:
                start, base, settled = origin() if origin is not None else (0, None, 0)
                cls._instances[key] = MarkerLog(conf, topic, partition, timeout, sink, lineage, start, base,
                                                settled)
            return cls._instances[key]

    def horizon(self, batch: int) -> tuple[int, int]:
        """(offset, epoch) a reader of this lineage may start from once every batch before
        ``batch`` is settled: at or before every marker of ``batch`` and later batches read so
        far, and not past the read position (a transaction still open there has later offsets:
        a read_committed reader stops before the first open one); with the highest epoch taken
        before that offset."""
        start = min([self.pos, *(off for b, off in self.first_offsets.items() if b >= batch)])
        base = max([self.base_epoch, *(e for off, e in self.epoch_offsets if off < start)])
        return start, base

    def is_settled(self, batch: int) -> bool:
        """Whether ``batch`` is decided: its decision was read, or it lies below a batch known
        decided whose older markers this reader skipped or forgot."""
        return (self.sink, self.lineage, batch) in self.decisions or batch < self.settled_below

    def latest_epoch(self, sink: str, lineage: str) -> int | None:
        """The highest epoch taken for (sink, lineage) as of the last refresh (None: none yet)."""
        return self.epochs.get((sink, lineage))

    def refresh(self, wait: float | None = None) -> MarkerLog:
        """Read up to the log end; raise :class:`MarkerWait` when an open transaction still holds
        the read_committed position after ``wait`` seconds (default: the timeout)."""
        from confluent_kafka import KafkaException, TopicPartition

        wait = self.timeout if wait is None else wait
        with self.lock:
            try:
                _, end = self.watermarks.get_watermark_offsets(self.tp, timeout=self.timeout, cached=False)
            except KafkaException as e:
                raise SinkError(f"{FORMAT}: cannot read the end of marker topic {self.topic} on "
                                f"{self.conf['bootstrap.servers']}: {error_text(e, self.conf)}") from None
            if end < self.start:  # the topic was re-created: the recorded start means nothing
                log.warning("%s: marker topic %s partition %d ends at %d, before the recorded start %d of "
                            "lineage %s: reading it from the beginning", FORMAT, self.topic, self.partition,
                            end, self.start, self.lineage)
                self.start = self.pos = self.recorded = self.base_epoch = self.settled_below = 0
                self.epochs.clear()
                self.consumer.assign([TopicPartition(self.topic, self.partition, 0)])
            deadline = time.monotonic() + wait
            while self.pos < end:
                for m in self.consumer.consume(1000, 0.2):
                    if m.error() is not None:
                        if m.error().fatal():
                            raise SinkError(f"{FORMAT}: reading marker topic {self.topic}: {m.error().str()}")
                        continue
                    if m.offset() >= self.pos:
                        self.records_read += 1
                        key = m.key()
                        if key == self._key or (key or b"").startswith(self._key + b"/"):
                            self._record(m.value(), m.offset())
                        self.pos = m.offset() + 1
                position = self.consumer.position([TopicPartition(self.topic, self.partition)])[0].offset
                if position is not None and position > self.pos:
                    self.pos = position
                if self.pos < end and time.monotonic() > deadline:
                    raise MarkerWait(
                        f"{FORMAT}: marker topic {self.topic} partition {self.partition}: read_committed "
                        f"position {self.pos} did not reach the log end {end} within {wait:g}s; "
                        "an open transaction holds it (a crashed task's transaction is aborted when "
                        "the task is retried, or after the sink's transaction_timeout). If it stays "
                        "there after the sink fenced the open transactions, the broker never "
                        "finalized one that ended: tansu 0.6 does that when two transactions on a "
                        "partition end at once (its log says otherwise=Some(Committed)); the "
                        "partition stays wedged until the broker restarts, and serialize_commits="
                        "true keeps it from happening again")
            self._forget_settled()
        return self

    def _forget_settled(self) -> None:
        """Drop markers of batches settled long ago: a lineage replays at most its latest
        batches (Spark wrote ``commits/N-1`` before batch N started), so memory stays flat."""
        decided = [k[2] for k in self.decisions if isinstance(k[2], int)]
        if not decided:
            return
        floor = max(decided) - KEEP_BATCHES
        if floor <= self.settled_below:
            return
        self.settled_below = floor  # below the latest decision: decided (batches decide in order)
        for d in (self.parts, self.decisions, self.ignored):
            for k in [k for k in d if isinstance(k[2], int) and k[2] < floor]:
                del d[k]
        for b in [b for b in self.first_offsets if b < floor]:
            del self.first_offsets[b]

    def _record(self, value: bytes | None, offset: int) -> None:
        try:
            m = json.loads(value or b"")
        except ValueError:
            return
        if not isinstance(m, dict):
            return
        sink, lineage, batch, kind = m.get("sink"), m.get("lineage"), m.get("batch"), m.get("type")
        if (sink, lineage) != (self.sink, self.lineage):
            return
        self.records_kept += 1
        if isinstance(batch, int) and kind in ("partition", "decision"):
            self.first_offsets.setdefault(batch, offset)
        if kind == "partition":
            self.parts.setdefault((sink, lineage, batch, m.get("partition")), m)
        elif kind == "decision":
            epoch = m.get("epoch") or 0
            if epoch < self.epochs.get((sink, lineage), 0):
                self.ignored.setdefault((sink, lineage, batch), []).append(m)
            else:
                self.decisions.setdefault((sink, lineage, batch), m)
        elif kind == "epoch" and isinstance(m.get("epoch"), int):
            self.epoch_offsets.append((offset, m["epoch"]))
            if m["epoch"] > self.epochs.get((sink, lineage), 0):
                self.epochs[(sink, lineage)] = m["epoch"]

    def uncommitted_txn_ids(self, sink: str, lineage: str) -> set[str]:
        """Transactional ids of this lineage with markers past the last stable offset (possibly
        open transactions of crashed tasks), read with read_uncommitted."""
        from confluent_kafka import Consumer, IsolationLevel, TopicPartition
        from confluent_kafka.admin import OffsetSpec

        admin = admin_client(self.conf)  # keep a reference until the future is resolved
        futs = admin.list_offsets({self.tp: OffsetSpec.latest()},
                                  isolation_level=IsolationLevel.READ_COMMITTED,
                                  request_timeout=self.timeout)
        stable = next(iter(futs.values())).result(self.timeout).offset
        _, end = self.watermarks.get_watermark_offsets(self.tp, timeout=self.timeout, cached=False)
        ids: set[str] = set()
        if stable >= end:
            return ids
        c = Consumer({**consumer_conf(self.conf), "group.id": f"onceflow-zombies-{uuid.uuid4().hex[:8]}",
                      "isolation.level": "read_uncommitted", "enable.auto.commit": False})
        try:
            c.assign([TopicPartition(self.topic, self.partition, max(stable, 0))])
            deadline, pos = time.monotonic() + self.timeout, stable
            while pos < end and time.monotonic() < deadline:
                for m in c.consume(1000, 0.2):
                    if m.error() is None:
                        pos = m.offset() + 1
                        try:
                            v = json.loads(m.value() or b"")
                        except ValueError:
                            continue
                        if isinstance(v, dict) and v.get("sink") == sink and v.get("lineage") == lineage and v.get("txn"):
                            ids.add(v["txn"])
                p = c.position([self.tp])[0].offset
                pos = max(pos, p if p is not None else pos)
        finally:
            c.close()
        return ids


def close_markers() -> None:
    """Close this process's cached marker readers and forget topic look-ups."""
    with MarkerLog._lock:
        for m in MarkerLog._instances.values():
            for c in (m.consumer, m.watermarks):
                try:
                    c.close()
                except Exception:  # noqa: BLE001 - already closed
                    pass
        MarkerLog._instances.clear()
    _MARKER_PARTS.clear()
    _ENSURED.clear()
