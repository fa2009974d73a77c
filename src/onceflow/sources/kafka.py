"""Kafka source for Structured Streaming on PySpark's Python Data Source API (confluent-kafka).

Guarantees:
- Offsets live only in Spark's checkpoint, as Spark's own Kafka source writes them:
  ``{"topic": {"0": 42}}`` = next offset to read per partition. Batch N reads exactly the
  ranges ``[offsets/N-1, offsets/N)`` on every replay; nothing is read back from Kafka's
  consumer groups (seeds/004: a savepoint/rollback must be able to rewind the source).
- ``startingOffsets`` / ``startingTimestamp`` only decide the very first batch of a new
  checkpoint; a restored query always continues from its checkpointed offsets.
- ``read_committed`` by default. Transaction markers leave offset gaps; a range ends when the
  consumer's position reaches its end offset, so gaps are never mistaken for data loss.
- Records removed before they were read (retention, topic re-created) fail the query with the
  topic, partition and offset range, unless ``failOnDataLoss=false``: then they are skipped,
  logged (WARNING, with a running count) and counted as ``source_data_loss`` events in the
  job's event log (``eventLog`` option; set automatically under a onceflow Job).
- Partitions that appear while running (new partitions, new topics matching the pattern) are
  read from offset 0; a partition whose log no longer starts at 0 then counts as data loss.
- ``groupId`` commits processed offsets after each batch for lag dashboards only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import re
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from onceflow.errors import ConfigError, OnceflowError
from onceflow.kafka_client import admin_client, error_text

log = logging.getLogger("onceflow.sources.kafka")

NAME = "onceflow-kafka"

SCHEMA = StructType([
    StructField("key", BinaryType()),
    StructField("value", BinaryType()),
    StructField("topic", StringType()),
    StructField("partition", IntegerType()),
    StructField("offset", LongType()),
    StructField("timestamp", TimestampType()),
    StructField("timestampType", IntegerType()),
    StructField("headers", ArrayType(StructType([
        StructField("key", StringType()), StructField("value", BinaryType()),
    ]))),
])

# Option names as Spark's Kafka source spells them (matched case-insensitively), plus
# ``kafka.<librdkafka property>`` for any consumer setting (security, timeouts, ...).
OPTIONS = {
    "kafka.bootstrap.servers": "host:port[,host:port] (required)",
    "subscribe": "comma-separated topic list (this or subscribePattern)",
    "subscribePattern": "regular expression of topics, re-evaluated every trigger",
    "startingOffsets": "earliest | latest (default) | JSON {\"t\":{\"0\":23,\"1\":-2}}",
    "startingTimestamp": "epoch ms; start at the first record at/after it (overrides startingOffsets)",
    "maxOffsetsPerTrigger": "cap on records per micro-batch, split across partitions (default none)",
    "failOnDataLoss": "true (default) | false: skip and log records lost before they were read",
    "groupId": "consumer group to commit processed offsets to, for lag monitoring only",
    "pollTimeoutMs": "max wait for a record that should exist while reading (default 120000)",
    "metadataTimeoutMs": "timeout of metadata/offset requests to the brokers (default 10000)",
    "eventLog": "the query's checkpoint directory (set by onceflow Jobs): skipped data loss is "
                "counted in its event log, the initial offsets of a new query are kept there",
}
_KNOWN = {k.lower(): k for k in OPTIONS}
_FORBIDDEN_KAFKA = {
    "kafka.group.id": "use groupId (commits are for monitoring only) instead",
    "kafka.enable.auto.commit": "offsets live in the checkpoint; nothing is auto-committed",
    "kafka.auto.offset.reset": "use startingOffsets",
}

TopicPartitionKey = tuple[str, int]
Offsets = dict[TopicPartitionKey, int]


class KafkaDataLossError(OnceflowError):
    """Records the query still had to read are gone from Kafka (retention, topic re-created)."""


def _fail(msg: str) -> ConfigError:
    return ConfigError(f"{NAME}: {msg}")


@dataclass(frozen=True)
class Settings:
    """Validated source options (picklable: shipped to the Python workers)."""

    consumer_conf: dict[str, str]
    topics: tuple[str, ...] = ()
    pattern: str | None = None
    starting: str | dict[str, dict[str, int]] = "latest"
    starting_timestamp: int | None = None
    max_offsets_per_trigger: int | None = None
    fail_on_data_loss: bool = True
    group_id: str | None = None
    poll_timeout_ms: int = 120_000
    metadata_timeout_ms: int = 10_000
    event_log: str | None = None

    @property
    def bootstrap(self) -> str:
        return self.consumer_conf["bootstrap.servers"]

    @property
    def read_committed(self) -> bool:
        return self.consumer_conf.get("isolation.level", "read_committed") == "read_committed"

    def wants(self, topic: str) -> bool:
        if self.pattern is not None:
            return re.fullmatch(self.pattern, topic) is not None and not topic.startswith("__")
        return topic in self.topics


def _int_option(opts: Mapping[str, str], name: str, default: int | None, minimum: int) -> int | None:
    raw = opts.get(name.lower())
    if raw is None:
        return default
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise _fail(f"option {name}={raw!r} is not an integer") from None
    if value < minimum:
        raise _fail(f"option {name}={value} must be at least {minimum}")
    return value


def _parse_starting(raw: str) -> str | dict[str, dict[str, int]]:
    text = raw.strip()
    if text.lower() in ("earliest", "latest"):
        return text.lower()
    hint = ("startingOffsets must be 'earliest', 'latest' or JSON like "
            "{\"topic\":{\"0\":23,\"1\":-2}} (-2 = earliest, -1 = latest)")
    try:
        parsed = json.loads(text)
    except ValueError:
        raise _fail(f"{hint}; got {raw!r}") from None
    ok = isinstance(parsed, dict) and parsed and all(
        isinstance(parts, dict) and parts and all(
            str(p).isdigit() and type(o) is int and o >= -2 for p, o in parts.items())
        for parts in parsed.values())
    if not ok:
        raise _fail(f"{hint}; got {raw!r}")
    return {t: {str(int(p)): o for p, o in parts.items()} for t, parts in parsed.items()}


def parse_options(options: Mapping[str, Any]) -> Settings:
    """Validate Spark options (no broker contact); raise ConfigError naming the bad option."""
    opts = {str(k).lower(): str(v) for k, v in options.items() if k.lower() != "path"}
    unknown = sorted(k for k in opts if k not in _KNOWN and not k.startswith("kafka."))
    if unknown:
        raise _fail(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(OPTIONS)}, kafka.*")
    for key, why in _FORBIDDEN_KAFKA.items():
        if key in opts:
            raise _fail(f"option {key} is not supported: {why}")
    conf = {k[len("kafka."):]: v for k, v in opts.items() if k.startswith("kafka.")}
    if not conf.get("bootstrap.servers", "").strip():
        raise _fail("option kafka.bootstrap.servers is required, e.g. 'localhost:9092'")
    conf.setdefault("isolation.level", "read_committed")
    if conf["isolation.level"] not in ("read_committed", "read_uncommitted"):
        raise _fail("kafka.isolation.level must be read_committed or read_uncommitted, "
                    f"got {conf['isolation.level']!r}")
    topics = tuple(t.strip() for t in opts.get("subscribe", "").split(",") if t.strip())
    pattern = opts.get("subscribepattern")
    if bool(topics) == bool(pattern):
        raise _fail("set exactly one of subscribe (topic list) or subscribePattern (regex)")
    if pattern:
        try:
            re.compile(pattern)
        except re.error as e:
            raise _fail(f"subscribePattern {pattern!r} is not a valid regular expression: {e}") from None
    starting = _parse_starting(opts.get("startingoffsets", "latest"))
    if isinstance(starting, dict) and topics:
        extra = sorted(set(starting) - set(topics))
        if extra:
            raise _fail(f"startingOffsets names topic(s) {', '.join(extra)} that are not in subscribe")
    fail_raw = opts.get("failondataloss", "true").strip().lower()
    if fail_raw not in ("true", "false"):
        raise _fail(f"option failOnDataLoss must be true or false, got {fail_raw!r}")
    return Settings(
        consumer_conf=conf,
        topics=topics,
        pattern=pattern,
        starting=starting,
        starting_timestamp=_int_option(opts, "startingTimestamp", None, 0),
        max_offsets_per_trigger=_int_option(opts, "maxOffsetsPerTrigger", None, 1),
        fail_on_data_loss=fail_raw == "true",
        group_id=opts.get("groupid") or None,
        poll_timeout_ms=_int_option(opts, "pollTimeoutMs", 120_000, 1),
        metadata_timeout_ms=_int_option(opts, "metadataTimeoutMs", 10_000, 1),
        event_log=opts.get("eventlog") or None,
    )


def to_json(offsets: Offsets) -> dict[str, dict[str, int]]:
    """``{(t, p): o}`` → Spark's ``{"t": {"p": o}}`` (sorted, so equal offsets look equal)."""
    out: dict[str, dict[str, int]] = {}
    for (t, p), o in sorted(offsets.items()):
        out.setdefault(t, {})[str(p)] = int(o)
    return out


def from_json(offsets: Mapping[str, Mapping[str, int]] | None) -> Offsets:
    return {(t, int(p)): int(o) for t, parts in (offsets or {}).items() for p, o in parts.items()}


def cap_offsets(start: Offsets, end: Offsets, limit: int) -> Offsets:
    """Limit ``end`` so at most ``limit`` offsets are read in total, split proportionally to
    what each partition has available; always makes progress when anything is available."""
    avail = {tp: o - start.get(tp, 0) for tp, o in end.items() if o > start.get(tp, 0)}
    total = sum(avail.values())
    if total <= limit:
        return dict(end)
    share = {tp: limit * n // total for tp, n in avail.items()}
    left = limit - sum(share.values())
    for tp in sorted(avail, key=lambda tp: (share[tp] - avail[tp], tp)):
        if left == 0:
            break
        if share[tp] < avail[tp]:
            share[tp] += 1
            left -= 1
    return {tp: start.get(tp, 0) + share[tp] if tp in avail else o for tp, o in end.items()}


def check_starting_partitions(settings: Settings, tps: Sequence[TopicPartitionKey]) -> Offsets:
    """Per-partition startingOffsets must name exactly the existing partitions (as in Spark)."""
    wanted = from_json(settings.starting if isinstance(settings.starting, dict) else {})
    missing = sorted(set(tps) - set(wanted))
    if missing:
        raise _fail("startingOffsets JSON must give every partition; missing "
                    + ", ".join(f"{t}:{p}" for t, p in missing))
    unknown = sorted(set(wanted) - set(tps))
    if unknown:
        raise _fail("startingOffsets names partitions that do not exist: "
                    + ", ".join(f"{t}:{p}" for t, p in unknown))
    return wanted


class KafkaCluster:
    """Driver-side metadata and offset look-ups (one admin client, created lazily)."""

    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self._admin = None

    @property
    def admin(self):
        if self._admin is None:
            from confluent_kafka import KafkaException

            try:
                self._admin = admin_client(self.s.consumer_conf, quiet=False)
            except (KafkaException, ValueError, TypeError) as e:
                raise _fail(f"invalid kafka.* option: {error_text(e, self.s.consumer_conf)}; see "
                            "librdkafka's CONFIGURATION.md") from None
        return self._admin

    def check(self) -> None:
        """Fail early: bad kafka.* options, unreachable brokers, unknown subscribed topics."""
        from confluent_kafka import Consumer, KafkaException

        try:
            Consumer({**self.s.consumer_conf, "group.id": "onceflow-check"}).close()
        except (KafkaException, ValueError, TypeError) as e:
            raise _fail(f"invalid kafka.* option: {error_text(e, self.s.consumer_conf)}; see "
                        "librdkafka's CONFIGURATION.md") from None
        found = self.partitions()
        missing = [t for t in self.s.topics if t not in {t2 for t2, _ in found}]
        if missing:
            raise _fail(f"topic(s) {', '.join(missing)} do not exist on {self.s.bootstrap}; "
                        "create them or fix the subscribe option")

    def partitions(self) -> list[TopicPartitionKey]:
        """Partitions of the subscribed topics (or topics matching the pattern) right now."""
        from confluent_kafka import KafkaException

        timeout = self.s.metadata_timeout_ms / 1000
        try:
            md = self.admin.list_topics(timeout=timeout)
        except KafkaException as e:
            raise _fail(f"cannot reach Kafka at {self.s.bootstrap} within {timeout:g}s "
                        f"({error_text(e, self.s.consumer_conf)}); check kafka.bootstrap.servers "
                        "and that the brokers are up") from None
        return sorted((t, p) for t, tm in md.topics.items()
                      if tm.error is None and self.s.wants(t) for p in tm.partitions)

    def list_offsets(self, tps: Sequence[TopicPartitionKey], spec: str | int,
                     committed: bool | None = None) -> Offsets:
        """``spec``: "earliest", "latest" (last stable offset under read_committed) or a
        timestamp in ms (→ first offset at/after it, or -1 when there is none)."""
        from confluent_kafka import IsolationLevel, KafkaException, TopicPartition
        from confluent_kafka.admin import OffsetSpec

        if not tps:
            return {}
        if spec == "earliest":
            off_spec = OffsetSpec.earliest()
        elif spec == "latest":
            off_spec = OffsetSpec.latest()
        else:
            off_spec = OffsetSpec.for_timestamp(int(spec))
        committed = self.s.read_committed if committed is None else committed
        level = IsolationLevel.READ_COMMITTED if committed else IsolationLevel.READ_UNCOMMITTED
        timeout = self.s.metadata_timeout_ms / 1000
        futures = self.admin.list_offsets(
            {TopicPartition(t, p): off_spec for t, p in tps},
            isolation_level=level, request_timeout=timeout)
        try:
            return {(tp.topic, tp.partition): f.result(timeout).offset for tp, f in futures.items()}
        except KafkaException as e:
            raise OnceflowError(f"{NAME}: listing {spec} offsets on {self.s.bootstrap} failed: "
                                f"{error_text(e, self.s.consumer_conf)}; the query will be restarted "
                                "by its restart strategy") from None


class KafkaInputPartition(InputPartition):
    """One Kafka partition's offset range ``[start, end)`` for one micro-batch."""

    def __init__(self, topic: str, partition: int, start: int, end: int) -> None:
        super().__init__((topic, partition, start, end))
        self.topic, self.partition, self.start, self.end = topic, partition, start, end


class KafkaStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Plans offset ranges on the driver; ``read`` fetches one range on an executor."""

    def __init__(self, settings: Settings, schema: StructType) -> None:
        self.s = settings
        self.schema = schema
        self._cluster: KafkaCluster | None = None
        self._available_now: Offsets | None = None
        self._group_committed: dict | None = None
        self.skipped_records = 0  # records lost to data loss and skipped (failOnDataLoss=false)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_cluster": None}

    @property
    def cluster(self) -> KafkaCluster:
        if self._cluster is None:
            self._cluster = KafkaCluster(self.s)
        return self._cluster

    # -- driver: offsets --------------------------------------------------------------------
    def initialOffset(self) -> dict:
        """Where a new query starts. Spark asks again when batch 0 is replayed after a crash
        (its end is in ``offsets/0``, its start is not): with ``eventLog`` (the checkpoint,
        set by onceflow Jobs) the first answer is kept there, one file per source
        configuration, as Spark's Kafka source keeps it in ``sources/0``, so a replayed batch 0
        reads the same range even for 'latest'.

        The file is written to a temporary name and renamed. An unreadable one (torn by a crash
        of an older version mid-write) counts as absent: Spark writes ``offsets/0`` only after
        this method returned, so no batch can have been planned from it."""
        saved = self._initial_path()
        if saved is None:
            return self._initial()
        from fsspec.core import url_to_fs

        fs, path = url_to_fs(saved)
        ident = self._identity()
        try:
            with fs.open(path, "r") as f:
                kept = json.load(f)
            if isinstance(kept, dict) and kept.get("source") == ident:
                return kept["offsets"]
        except FileNotFoundError:
            pass
        except ValueError as e:
            log.warning("%s: %s is unreadable (%s); computing the initial offsets again", NAME, saved, e)
        offsets = self._initial()
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
        with fs.open(tmp, "w") as f:
            json.dump({"source": ident, "offsets": offsets}, f)
        fs.mv(tmp, path)
        return offsets

    def _initial_path(self) -> str | None:
        """``<checkpoint>/_onceflow/kafka-initial-offsets-<hash of the source's configuration>.json``:
        two Kafka sources of one query keep their answers apart."""
        if not self.s.event_log:
            return None
        key = hashlib.sha256(self._identity().encode()).hexdigest()[:16]
        return f"{self.s.event_log.rstrip('/')}/_onceflow/kafka-initial-offsets-{key}.json"

    def _identity(self) -> str:
        return json.dumps([self.s.bootstrap, sorted(self.s.topics), self.s.pattern, self.s.starting,
                           self.s.starting_timestamp], sort_keys=True)

    def _initial(self) -> dict:
        tps = self.cluster.partitions()
        if self.s.starting_timestamp is not None:
            found = self.cluster.list_offsets(tps, self.s.starting_timestamp)
            latest = self.cluster.list_offsets([tp for tp, o in found.items() if o < 0], "latest")
            return to_json({tp: latest.get(tp, o) for tp, o in found.items()})
        if isinstance(self.s.starting, str):
            return to_json(self.cluster.list_offsets(tps, self.s.starting))
        wanted = check_starting_partitions(self.s, tps)
        earliest = self.cluster.list_offsets([tp for tp, o in wanted.items() if o == -2], "earliest")
        latest = self.cluster.list_offsets([tp for tp, o in wanted.items() if o == -1], "latest")
        return to_json({tp: earliest.get(tp, latest.get(tp, o)) for tp, o in wanted.items()})

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.s.max_offsets_per_trigger
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._available_now = self._latest()

    def latestOffset(self, start: dict | None = None, limit: ReadLimit | None = None) -> dict:
        begin = from_json(start)
        # Spark plans batch N+1 only after batch N (ending at ``start``) is committed, and never
        # calls commit() for the last batch before a stop: report lag from here as well.
        self.commit(start or {})
        latest = self._latest()
        if self._available_now is not None:  # Trigger.AvailableNow: nothing after the target
            latest = {tp: min(o, self._available_now.get(tp, begin.get(tp, 0)))
                      for tp, o in latest.items()}
        end = dict(begin)  # partitions that vanished keep their offsets
        behind = [tp for tp, o in latest.items() if o < begin.get(tp, 0)]
        truncated = self._truncated(begin, behind)
        for tp, o in latest.items():
            end[tp] = o if tp in truncated else max(o, begin.get(tp, 0))
        if isinstance(limit, ReadMaxRows):
            end = cap_offsets(begin, end, limit.max_rows)
        return to_json(end)

    def reportLatestOffset(self) -> dict | None:
        return to_json(self._latest())

    def _latest(self) -> Offsets:
        return self.cluster.list_offsets(self.cluster.partitions(), "latest")

    def _truncated(self, begin: Offsets, behind: list[TopicPartitionKey]) -> set[TopicPartitionKey]:
        """Partitions whose log really ends before ``begin`` (topic re-created / truncated).

        The last stable offset alone can trail ``begin`` without any loss (tansu reports 0 while
        a transaction is open), so the uncommitted end of the log decides.
        """
        if not behind:
            return set()
        high = self.cluster.list_offsets(behind, "latest", committed=False)
        gone = {tp for tp in behind if high[tp] < begin[tp]}
        for t, p in sorted(gone):
            msg = (f"topic {t} partition {p}: the log now ends at offset {high[(t, p)]} but the "
                   f"checkpoint already read up to {begin[(t, p)]} (topic deleted and re-created, "
                   "or log truncated); records after the checkpointed offset may be lost")
            if self.s.fail_on_data_loss:
                raise KafkaDataLossError(f"{NAME}: {msg}. Restore from a savepoint, or set "
                                         "failOnDataLoss=false to continue from the new log's start")
            log.warning("%s: %s; failOnDataLoss=false: reading the new log from its start", NAME, msg)
            record_data_loss(self.s, t, p, begin[(t, p)], high[(t, p)], None, "log truncated or re-created")
        return gone

    # -- driver: planning -------------------------------------------------------------------
    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        begin, stop = from_json(start), from_json(end)
        ranges = []
        for (t, p), hi in sorted(stop.items()):
            lo = begin.get((t, p), 0)
            if hi < lo:  # log re-created (failOnDataLoss=false): read the new log up to hi
                lo = 0
            if hi > lo:
                ranges.append((t, p, lo, hi))
        earliest = self.cluster.list_offsets([(t, p) for t, p, _, _ in ranges], "earliest")
        parts: list[InputPartition] = []
        for t, p, lo, hi in ranges:
            low = earliest[(t, p)]
            if lo < low:
                lo = self._data_loss(t, p, lo, min(low, hi))
            if hi > lo:
                parts.append(KafkaInputPartition(t, p, lo, hi))
        return parts

    def _data_loss(self, topic: str, partition: int, lo: int, low: int) -> int:
        msg = (f"topic {topic} partition {partition}: offsets [{lo}, {low}) were deleted "
               "(retention or deleteRecords) before the query read them")
        if self.s.fail_on_data_loss:
            raise KafkaDataLossError(f"{NAME}: {msg}. Restore from a savepoint, or set "
                                     "failOnDataLoss=false to skip them")
        self.skipped_records += low - lo
        log.warning("%s: %s; skipped %d records (failOnDataLoss=false, %d skipped so far)",
                    NAME, msg, low - lo, self.skipped_records)
        record_data_loss(self.s, topic, partition, lo, low, low - lo, "deleted before planning",
                         self.skipped_records)
        return low

    # -- executor ---------------------------------------------------------------------------
    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, KafkaInputPartition)
        return read_range(self.s, self.schema, partition)

    # -- driver: after the batch is committed -----------------------------------------------
    def commit(self, end: dict) -> None:
        """Commit processed offsets to ``groupId`` for lag dashboards; never read back, and a
        failure is only logged (the checkpoint, not the group, is the source of truth)."""
        if not self.s.group_id or not end or end == self._group_committed:
            return
        self._group_committed = end
        from confluent_kafka import Consumer, KafkaException, TopicPartition

        offsets = [TopicPartition(t, p, o) for (t, p), o in from_json(end).items()]
        consumer = Consumer({**self.s.consumer_conf, "group.id": self.s.group_id,
                             "enable.auto.commit": False})
        try:
            consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as e:
            log.warning("%s: committing offsets to group %s failed (monitoring only): %s",
                        NAME, self.s.group_id, e)
        finally:
            consumer.close()

    def stop(self) -> None:
        self._cluster = None


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
    chunks: queue.Queue = queue.Queue(maxsize=4)
    done = threading.Event()

    def pump() -> None:
        try:
            for msgs in _fetch(settings, part, batch_rows, done):
                while not done.is_set():
                    try:
                        chunks.put(msgs, timeout=0.5)
                        break
                    except queue.Full:
                        continue
            chunks.put(None)
        except BaseException as e:  # noqa: BLE001 - handed to the reading thread
            chunks.put(e)

    fetcher = threading.Thread(target=pump, name=f"onceflow-kafka-{part.topic}-{part.partition}",
                               daemon=True)
    fetcher.start()
    try:
        while (item := chunks.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield _batch(item, part.topic, part.partition, arrow_schema)
    finally:
        done.set()
        fetcher.join(timeout=30)


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
                raise OnceflowError(
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


class KafkaSourceDataSource(DataSource):
    """``spark.readStream.format("onceflow-kafka")`` with Spark's Kafka option names."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType:
        parse_options(self.options)  # bad options fail at load(), not at the first batch
        return SCHEMA

    def streamReader(self, schema: StructType) -> KafkaStreamReader:
        settings = parse_options(self.options)
        reader = KafkaStreamReader(settings, schema)
        reader.cluster.check()
        return reader


@dataclass
class KafkaSource:
    """User-facing configuration of the Kafka source; ``load(spark)`` returns the stream.

    ``load`` validates everything it can before Spark starts (options, reachability of the
    brokers within ``metadata_timeout_ms``, existence of the topics) and raises ConfigError.
    """

    bootstrap_servers: str
    topics: str | Sequence[str] | None = None
    pattern: str | None = None
    starting_offsets: str | Mapping[str, Mapping[str, int]] = "latest"
    starting_timestamp: int | None = None
    max_offsets_per_trigger: int | None = None
    isolation_level: str = "read_committed"
    fail_on_data_loss: bool = True
    group_id: str | None = None
    consumer_options: Mapping[str, str] = field(default_factory=dict)
    poll_timeout_ms: int = 120_000
    metadata_timeout_ms: int = 10_000
    event_log: str | None = None

    def options(self) -> dict[str, str]:
        """The Spark options this configuration stands for."""
        opts = {f"kafka.{k}": str(v) for k, v in self.consumer_options.items()}
        opts["kafka.bootstrap.servers"] = self.bootstrap_servers
        opts["kafka.isolation.level"] = self.isolation_level
        if self.topics:
            opts["subscribe"] = self.topics if isinstance(self.topics, str) else ",".join(self.topics)
        if self.pattern:
            opts["subscribePattern"] = self.pattern
        opts["startingOffsets"] = (self.starting_offsets if isinstance(self.starting_offsets, str)
                                   else json.dumps(self.starting_offsets))
        opts["failOnDataLoss"] = str(self.fail_on_data_loss).lower()
        opts["pollTimeoutMs"] = str(self.poll_timeout_ms)
        opts["metadataTimeoutMs"] = str(self.metadata_timeout_ms)
        for name, value in (("startingTimestamp", self.starting_timestamp),
                            ("maxOffsetsPerTrigger", self.max_offsets_per_trigger),
                            ("groupId", self.group_id), ("eventLog", self.event_log)):
            if value is not None:
                opts[name] = str(value)
        return opts

    def validate(self) -> Settings:
        """Check options and the cluster now; raise ConfigError with what to fix."""
        settings = parse_options(self.options())
        KafkaCluster(settings).check()
        return settings

    def load(self, spark):
        """Validate, then ``spark.readStream.format("onceflow-kafka").options(...).load()``.

        Under a onceflow Job, ``event_log`` defaults to the job's checkpoint directory."""
        self.validate()
        opts = self.options()
        if self.event_log is None:
            ckpt = spark.conf.get("spark.onceflow.checkpointLocation", None)
            if ckpt:
                opts["eventLog"] = ckpt
        return spark.readStream.format(NAME).options(**opts).load()
