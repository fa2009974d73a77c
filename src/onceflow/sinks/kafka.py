"""Kafka sink on confluent-kafka: transactional producers per (lineage, partition) with markers.

Kafka cannot hold a transaction open across producer sessions (no cross-session prepare in
the client), so the two-phase commit of DESIGN.md section 3 maps onto Kafka like this:

* **pre-commit = commit per task.** Each Spark task (batch N, partition p) uses a transactional
  producer with the stable ``transactional.id`` ``onceflow-<sink_id>-<lineage>-p<p>``.
  ``init_transactions()`` fences every older attempt of the same partition (a zombie's open
  transaction is aborted, its later commit fails). The task then looks for the partition's
  *marker*; if none is committed it begins a transaction, produces the rows and a marker
  record ``{batch, partition, attempt, rows, fingerprint}`` to the marker topic
  (``__onceflow_markers``), and commits the Kafka transaction. Rows and marker become visible
  together, per partition, when the task commits: **a batch becomes visible partition by
  partition, not atomically**, to ``read_committed`` consumers.
* **replay skips committed partitions.** A replayed batch (same offsets, same lineage) skips
  every partition whose marker is committed, so each partition's rows are written once.
* **decide** (driver) writes a decision marker with the batch's fingerprint (hash of
  ``offsets/N``) through a transactional producer ``onceflow-<sink_id>-<lineage>-driver``
  (fences a zombie driver). A replay of a decided batch writes nothing; a replay whose
  fingerprint differs from the stored one stops the query (FingerprintMismatch), at batch
  level in the driver and at partition level in the task.
* **commit** is a no-op (visible since the tasks committed); **abort** cannot un-commit a
  partition that is already visible: the batch is replayed after the restart and its
  committed partitions are skipped.

Guarantees: ``exactly_once`` (default): every output record is committed exactly once per
lineage for ``read_committed`` consumers, with the same conditions as everywhere in onceflow
(replayable source, deterministic transform *and deterministic partitioning* of the batch).
It is only offered when the broker hides aborted transactional records from
``read_committed`` consumers: :func:`probe` checks that before the first query starts and the
sink refuses to start otherwise (tansu, for one, does not filter them). ``at_least_once``
(explicit): idempotent, non-transactional producer; replays write their rows again.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pyspark.sql.types import BinaryType, IntegerType, StringType, StructType

from onceflow.errors import ConfigError, FingerprintMismatch, SinkError
from onceflow.faults import maybe_crash
from onceflow.sinks.base import Decision, Sink, TaskInfo, TwoPhaseCommitSink

log = logging.getLogger("onceflow.sinks.kafka")

FORMAT = "onceflow-kafka-sink"
MARKER_TOPIC = "__onceflow_markers"
PROBE_TOPIC = "__onceflow_probe"
MODES = ("exactly_once", "at_least_once")

GUARANTEES = {
    "exactly_once": (
        "exactly-once for read_committed consumers: each partition of a batch is committed in one "
        "Kafka transaction with its marker and skipped on replay; a batch becomes visible "
        "partition by partition (not atomically); needs a broker that hides aborted records"
    ),
    "at_least_once": (
        "at-least-once (explicit): idempotent producer without transactions; a replayed batch "
        "writes its rows again, consumers must deduplicate"
    ),
}


# ---- broker probe ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeResult:
    """Whether the broker hides aborted transactional records from read_committed consumers."""

    ok: bool
    detail: str


@dataclass(frozen=True)
class CheckResult:
    """One ``onceflow doctor --kafka`` check (same shape as the PostgreSQL doctor's)."""

    name: str
    ok: bool
    detail: str


_PROBES: dict[tuple[str, str], ProbeResult] = {}
_PROBE_LOCK = threading.Lock()


def _admin(conf: Mapping[str, Any]):
    from confluent_kafka.admin import AdminClient

    # log_level 0: failures surface as exceptions with the cause; no reconnect spam on stderr
    return AdminClient({"log_level": 0, **_consumer_conf(conf)})


def _reachable(conf: Mapping[str, Any], timeout: float):
    """Cluster metadata, or ConfigError naming the bootstrap servers."""
    from confluent_kafka import KafkaException

    try:
        return _admin(conf).list_topics(timeout=timeout)
    except KafkaException as e:
        raise ConfigError(
            f"{FORMAT}: cannot reach Kafka at {conf['bootstrap.servers']} within {timeout:g}s "
            f"({e.args[0]}); check bootstrap_servers and that the brokers are up"
        ) from None
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{FORMAT}: invalid producer_config: {e}; see librdkafka's CONFIGURATION.md") from None


def _ensure_topic(conf: Mapping[str, Any], topic: str, timeout: float) -> int:
    """Create ``topic`` with one partition if it does not exist; return its partition count."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import NewTopic

    admin = _admin(conf)
    md = admin.list_topics(timeout=timeout).topics.get(topic)
    if md is not None and md.error is None and md.partitions:
        return len(md.partitions)
    try:
        for fut in admin.create_topics([NewTopic(topic, 1, 1)], request_timeout=timeout).values():
            fut.result(timeout)
    except KafkaException as e:
        if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise ConfigError(
                f"{FORMAT}: topic {topic} does not exist on {conf['bootstrap.servers']} and could "
                f"not be created ({e.args[0].str()}); create it (1 partition is enough) or grant "
                "CreateTopics"
            ) from None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        md = admin.list_topics(topic, timeout=timeout).topics.get(topic)
        if md is not None and md.error is None and md.partitions:
            return len(md.partitions)
        time.sleep(0.1)
    raise ConfigError(f"{FORMAT}: topic {topic} did not appear on {conf['bootstrap.servers']} within {timeout:g}s")


def probe(bootstrap: str, timeout: float = 20.0, producer_config: Mapping[str, Any] | None = None,
          topic: str = PROBE_TOPIC) -> ProbeResult:
    """Produce one record in an aborted transaction and one in a committed transaction to
    ``topic``, read them back with ``read_committed``: ok when only the committed one is seen.

    Raises ConfigError when the broker cannot be reached; every other outcome is a result.
    """
    from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

    conf = {**(producer_config or {}), "bootstrap.servers": bootstrap}
    _reachable(conf, timeout)
    _ensure_topic(conf, topic, timeout)
    tag = uuid.uuid4().hex
    aborted, committed = f"aborted-{tag}".encode(), f"committed-{tag}".encode()
    wm = Consumer({**_consumer_conf(conf), "group.id": f"onceflow-probe-{tag}", "isolation.level": "read_uncommitted"})
    try:
        _, start = wm.get_watermark_offsets(TopicPartition(topic, 0), timeout=timeout, cached=False)
    finally:
        wm.close()
    producer = Producer({**conf, "transactional.id": f"onceflow-probe-{tag}", "linger.ms": 0,
                         "transaction.timeout.ms": int(timeout * 1000)})
    try:
        producer.init_transactions(timeout)
        producer.begin_transaction()
        producer.produce(topic, aborted, partition=0)
        producer.flush(timeout)
        producer.abort_transaction(timeout)
        producer.begin_transaction()
        producer.produce(topic, committed, partition=0)
        producer.commit_transaction(timeout)
    except KafkaException as e:
        return ProbeResult(False, f"transactions do not work on {bootstrap}: {e.args[0].str()}; "
                                  "exactly_once needs transactions (Kafka 0.11+, transaction state log)")
    consumer = Consumer({**_consumer_conf(conf), "group.id": f"onceflow-probe-{tag}", "isolation.level": "read_committed",
                         "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    seen_aborted = seen_committed = False
    try:
        consumer.assign([TopicPartition(topic, 0, max(start, 0))])
        deadline = time.monotonic() + timeout
        while not seen_committed and time.monotonic() < deadline:
            for m in consumer.consume(100, 0.5):
                if m.error() is None:
                    seen_aborted |= m.value() == aborted
                    seen_committed |= m.value() == committed
    finally:
        consumer.close()
    if not seen_committed:
        return ProbeResult(False, f"the committed probe record was not readable with read_committed "
                                  f"within {timeout:g}s on {bootstrap}; transactions do not complete")
    if seen_aborted:
        return ProbeResult(False, (
            f"the broker at {bootstrap} does not filter aborted transactions: a read_committed "
            "consumer saw a record of an aborted transaction, so read_committed consumers would "
            "see duplicates from retried tasks"))
    return ProbeResult(True, f"the broker at {bootstrap} hides aborted transactional records from "
                             "read_committed consumers")


def cached_probe(bootstrap: str, timeout: float = 20.0, producer_config: Mapping[str, Any] | None = None) -> ProbeResult:
    """:func:`probe`, once per (bootstrap, producer config) per process: another config (other
    credentials, another listener) may reach a different broker behaviour, so it is probed anew."""
    key = (bootstrap, json.dumps(dict(producer_config or {}), sort_keys=True, default=str))
    with _PROBE_LOCK:
        if key not in _PROBES:
            _PROBES[key] = probe(bootstrap, timeout, producer_config)
        return _PROBES[key]


def doctor(bootstrap: str, timeout: float = 20.0) -> list[CheckResult]:
    """Checks for ``onceflow doctor --kafka``: reachability, transactions / aborted-record
    filtering (the probe), marker topic, and the guarantee each mode gives on this broker."""
    conf = {"bootstrap.servers": bootstrap}
    try:
        md = _reachable(conf, timeout)
    except ConfigError as e:
        return [CheckResult("reachable", False, str(e))]
    results = [CheckResult("reachable", True, f"{bootstrap}: {len(md.brokers)} broker(s), {len(md.topics)} topic(s)")]
    try:
        result = probe(bootstrap, timeout)
    except ConfigError as e:
        result = ProbeResult(False, str(e))
    results.append(CheckResult("aborted_records_hidden", result.ok, result.detail))
    marker = md.topics.get(MARKER_TOPIC)
    results.append(CheckResult(
        "marker_topic", True,
        f"{MARKER_TOPIC} exists ({len(marker.partitions)} partition(s))" if marker is not None and marker.error is None
        else f"{MARKER_TOPIC} missing; created with 1 partition when the first exactly_once query starts",
    ))
    if result.ok:
        eo = f"mode exactly_once: available; {GUARANTEES['exactly_once']}"
    else:
        eo = ("mode exactly_once: REFUSED on this broker (see aborted_records_hidden); use "
              "mode='at_least_once' explicitly, or a broker with working read_committed. A sink "
              "started with skip_broker_probe=true runs anyway WITHOUT this guarantee (its job's "
              "event log records 'guarantee_unverified')")
    results.append(CheckResult("guarantee_exactly_once", result.ok, eo))
    results.append(CheckResult("guarantee_at_least_once", True, f"mode at_least_once: {GUARANTEES['at_least_once']}"))
    return results


# ---- marker log ------------------------------------------------------------------------------


class MarkerWait(SinkError):
    """An open transaction holds the marker partition's read_committed position."""


def marker_partition(key: str, partitions: int) -> int:
    return zlib.crc32(key.encode()) % max(partitions, 1)


class MarkerLog:
    """What the marker topic says, read with read_committed and cached per process.

    :meth:`refresh` reads on from the last position until the consumer's position reaches the
    log end (uncommitted high watermark) taken when the refresh started: a read_committed
    consumer stops at the last stable offset, so this also waits for transactions open on the
    marker partition to finish (markers are produced last in a transaction, so that window is
    short). Aborted markers are invisible only on brokers that pass :func:`probe`.
    """

    _instances: ClassVar[dict[tuple, MarkerLog]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, conf: Mapping[str, Any], topic: str, partition: int, timeout: float):
        from confluent_kafka import Consumer, TopicPartition

        self.conf, self.topic, self.partition, self.timeout = dict(conf), topic, partition, timeout
        self.tp = TopicPartition(topic, partition)
        self.parts: dict[tuple[str, str, int, int], dict] = {}
        self.decisions: dict[tuple[str, str, int], dict] = {}
        self.pos = 0
        base = {**_consumer_conf(conf), "enable.auto.commit": False, "enable.partition.eof": False,
                "auto.offset.reset": "earliest"}
        self.consumer = Consumer({**base, "group.id": f"onceflow-markers-{uuid.uuid4().hex[:8]}",
                                  "isolation.level": "read_committed"})
        self.consumer.assign([TopicPartition(topic, partition, 0)])
        self.watermarks = Consumer({**base, "group.id": f"onceflow-markers-wm-{uuid.uuid4().hex[:8]}",
                                    "isolation.level": "read_uncommitted"})
        self.lock = threading.Lock()

    @classmethod
    def get(cls, conf: Mapping[str, Any], topic: str, partition: int, timeout: float) -> MarkerLog:
        key = (conf["bootstrap.servers"], topic, partition)
        with cls._lock:
            if key not in cls._instances:
                cls._instances[key] = MarkerLog(conf, topic, partition, timeout)
            return cls._instances[key]

    def refresh(self, wait: float | None = None) -> MarkerLog:
        """Read up to the log end; raise :class:`MarkerWait` when an open transaction still holds
        the read_committed position after ``wait`` seconds (default: the timeout)."""
        from confluent_kafka import KafkaException, TopicPartition

        wait = self.timeout if wait is None else wait
        with self.lock:
            try:
                _, end = self.watermarks.get_watermark_offsets(self.tp, timeout=self.timeout, cached=False)
            except KafkaException as e:
                raise SinkError(f"{FORMAT}: cannot read the end of marker topic {self.topic}: {e.args[0].str()}") from None
            deadline = time.monotonic() + wait
            while self.pos < end:
                for m in self.consumer.consume(1000, 0.2):
                    if m.error() is not None:
                        if m.error().fatal():
                            raise SinkError(f"{FORMAT}: reading marker topic {self.topic}: {m.error().str()}")
                        continue
                    self._record(m.key(), m.value())
                    self.pos = max(self.pos, m.offset() + 1)
                position = self.consumer.position([TopicPartition(self.topic, self.partition)])[0].offset
                if position is not None and position > self.pos:
                    self.pos = position
                if self.pos < end and time.monotonic() > deadline:
                    raise MarkerWait(
                        f"{FORMAT}: marker topic {self.topic} partition {self.partition}: read_committed "
                        f"position {self.pos} did not reach the log end {end} within {wait:g}s; "
                        "an open transaction holds it (a crashed task's transaction is aborted when "
                        "the task is retried, or after transaction.timeout.ms)")
        return self

    def _record(self, key: bytes | None, value: bytes | None) -> None:
        try:
            m = json.loads(value or b"")
        except ValueError:
            return
        if not isinstance(m, dict):
            return
        sink, lineage, batch = m.get("sink"), m.get("lineage"), m.get("batch")
        if m.get("type") == "partition":
            self.parts.setdefault((sink, lineage, batch, m.get("partition")), m)
        elif m.get("type") == "decision":
            self.decisions.setdefault((sink, lineage, batch), m)

    def uncommitted_txn_ids(self, sink: str, lineage: str) -> set[str]:
        """Transactional ids of this lineage with markers past the last stable offset (possibly
        open transactions of crashed tasks), read with read_uncommitted."""
        from confluent_kafka import Consumer, IsolationLevel, TopicPartition
        from confluent_kafka.admin import OffsetSpec

        admin = _admin(self.conf)  # keep a reference until the future is resolved
        futs = admin.list_offsets({self.tp: OffsetSpec.latest()},
                                  isolation_level=IsolationLevel.READ_COMMITTED,
                                  request_timeout=self.timeout)
        stable = next(iter(futs.values())).result(self.timeout).offset
        _, end = self.watermarks.get_watermark_offsets(self.tp, timeout=self.timeout, cached=False)
        ids: set[str] = set()
        if stable >= end:
            return ids
        c = Consumer({**_consumer_conf(self.conf), "group.id": f"onceflow-zombies-{uuid.uuid4().hex[:8]}",
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


def close_all() -> None:
    """Close this process's cached marker readers and producers (tests, short-lived CLIs)."""
    with MarkerLog._lock:
        for m in MarkerLog._instances.values():
            for c in (m.consumer, m.watermarks):
                try:
                    c.close()
                except Exception:  # noqa: BLE001 - already closed
                    pass
        MarkerLog._instances.clear()
    _PRODUCERS.clear()
    _MARKER_PARTS.clear()
    _KNOWN_TOPICS.clear()


def _consumer_conf(conf: Mapping[str, Any]) -> dict:
    """Producer config minus producer-only properties (security settings carry over)."""
    producer_only = ("transaction", "enable.idempotence", "linger", "batch", "partitioner", "acks",
                     "compression", "queue.buffering", "message.timeout", "delivery.timeout",
                     "retries", "max.in.flight", "sticky", "message.send")
    return {k: v for k, v in conf.items() if not k.startswith(producer_only)}


# ---- producers (cached per Python worker process) ------------------------------------------

_PRODUCERS: dict[str, Any] = {}
_FENCED: dict[str, tuple[int, int]] = {}  # txn id -> (batch, attempt) whose is_decided fenced it
_KNOWN_TOPICS: dict[tuple[str, str], bool] = {}


def _transactional_producer(conf: Mapping[str, Any], txn_id: str, timeout: float, fresh: bool = False):
    """An initialised transactional producer for ``txn_id``; ``init_transactions`` fences
    every older producer (attempt) with the same id and aborts its open transaction."""
    from confluent_kafka import KafkaException, Producer

    producer = None if fresh else _PRODUCERS.get(txn_id)
    if producer is None:
        producer = Producer({**conf, "transactional.id": txn_id})
        try:
            producer.init_transactions(timeout)
        except KafkaException as e:
            raise SinkError(f"{FORMAT}: init_transactions for {txn_id} on {conf['bootstrap.servers']} "
                            f"failed: {e.args[0].str()}") from None
        _PRODUCERS[txn_id] = producer
    return producer


def _drop_producer(txn_id: str) -> None:
    _PRODUCERS.pop(txn_id, None)


# ---- the data source -------------------------------------------------------------------------


class KafkaDataSource(TwoPhaseCommitSink):
    """``df.writeStream.format("onceflow-kafka-sink").option("bootstrap_servers", ...)``.

    Input columns as for Spark's Kafka sink: ``value`` (binary or string, required), ``key``
    (binary or string, optional), ``topic`` (string, optional; else the ``topic`` option),
    ``partition`` (int, optional), ``headers`` (array<struct<key string, value binary>>, optional).
    """

    format_name = FORMAT
    required_options = ("bootstrap_servers",)
    #: False: reading markers never fences another transaction (restore checks set this, as a
    #: live job of the same lineage may be running beside them).
    fence_stale: bool = True
    options_doc = {
        "bootstrap_servers": "host:port[,host:port] of the Kafka cluster (required)",
        "topic": "topic to write to (else each row's topic column)",
        "key_column": "column holding the record key (default 'key'; optional in the input)",
        "value_column": "column holding the record value (default 'value')",
        "topic_column": "column holding a per-row topic (default 'topic'; used if present)",
        "mode": "exactly_once (default; transactions + markers) or at_least_once (explicit)",
        "producer_config": "JSON object of extra librdkafka producer properties (security, ...)",
        "sink_id": "name of this sink in the job, part of transactional ids and markers (default 'kafka')",
        "marker_topic": f"topic for batch markers (default {MARKER_TOPIC}; created if missing)",
        "timeout": "seconds for metadata, transaction and marker operations (default 60)",
        "skip_broker_probe": ("tests only: do not check that the broker hides aborted records; "
                              "exactly-once is then NOT verified (warning logged, event "
                              "'guarantee_unverified' in the job's event log)"),
    }

    def __init__(self, options):
        super().__init__(options)
        o = self.opts
        self.bootstrap = o["bootstrap_servers"]
        self.topic = o.get("topic") or None
        self.key_column = o.get("key_column", "key")
        self.value_column = o.get("value_column", "value")
        self.topic_column = o.get("topic_column", "topic")
        self.mode = o.get("mode", "exactly_once").lower()
        self.sink_id = o.get("sink_id", "kafka")
        self.marker_topic = o.get("marker_topic", MARKER_TOPIC)
        self.skip_probe = o.get("skip_broker_probe", "false").lower() in ("true", "1", "yes")
        if self.mode not in MODES:
            raise ConfigError(f"{FORMAT}: mode={self.mode!r}; use 'exactly_once' or 'at_least_once'")
        try:
            self.timeout = float(o.get("timeout", 60))
        except ValueError:
            raise ConfigError(f"{FORMAT}: timeout={o.get('timeout')!r} is not a number of seconds") from None
        try:
            extra = json.loads(o.get("producer_config") or "{}")
        except ValueError as e:
            raise ConfigError(f"{FORMAT}: producer_config is not a JSON object: {e}") from None
        if not isinstance(extra, dict):
            raise ConfigError(f"{FORMAT}: producer_config must be a JSON object of librdkafka properties")
        for bad in ("transactional.id", "enable.idempotence", "bootstrap.servers"):
            if bad in extra:
                raise ConfigError(f"{FORMAT}: producer_config must not set {bad}; onceflow sets it")
        # murmur2_random: same key -> partition mapping as Java clients and Spark's Kafka sink.
        self.conf: dict[str, Any] = {
            "partitioner": "murmur2_random", "linger.ms": 5,
            **{str(k): v for k, v in extra.items()},
            "bootstrap.servers": self.bootstrap, "enable.idempotence": True,
        }
        if self.mode == "exactly_once":
            self.conf.setdefault("transaction.timeout.ms", int(self.timeout * 1000))

    def __repr__(self) -> str:
        return f"KafkaDataSource({self.bootstrap}, topic={self.topic}, mode={self.mode}, sink_id={self.sink_id})"

    def describe_guarantee(self) -> str:
        if self.mode == "exactly_once" and self.skip_probe:
            return (f"{GUARANTEES[self.mode]}; NOT VERIFIED: skip_broker_probe=true bypassed the check "
                    "that the broker hides aborted records")
        return GUARANTEES[self.mode]

    # ---- names ---------------------------------------------------------------------------

    def txn_id(self, lineage: str, partition: int | str) -> str:
        return f"onceflow-{self.sink_id}-{lineage}-p{partition}"

    def marker_key(self, lineage: str) -> str:
        return f"{self.sink_id}/{lineage}"

    def _markers(self, lineage: str) -> MarkerLog:
        n = _marker_partitions(self.conf, self.marker_topic, self.timeout)
        return MarkerLog.get(self.conf, self.marker_topic, marker_partition(self.marker_key(lineage), n), self.timeout)

    # ---- validation ----------------------------------------------------------------------

    def validate(self, schema: StructType, overwrite: bool) -> None:
        md = _reachable(self.conf, min(self.timeout, 15))
        fields = {f.name: f.dataType for f in schema.fields}
        if self.value_column not in fields:
            raise ConfigError(f"{FORMAT}: the stream has no {self.value_column!r} column (columns: "
                              f"{', '.join(fields)}); select the record value as 'value' or set value_column")
        for col in (self.value_column, self.key_column):
            if col in fields and not isinstance(fields[col], BinaryType | StringType):
                raise ConfigError(f"{FORMAT}: column {col!r} is {fields[col].simpleString()}; cast it to "
                                  "string or binary")
        if "partition" in fields and not isinstance(fields["partition"], IntegerType):
            raise ConfigError(f"{FORMAT}: column 'partition' must be int, got {fields['partition'].simpleString()}")
        if self.topic is None:
            if not isinstance(fields.get(self.topic_column), StringType):
                raise ConfigError(f"{FORMAT}: no topic: set the topic option or give a string column "
                                  f"{self.topic_column!r}")
        else:
            t = md.topics.get(self.topic)
            if t is None or t.error is not None:
                raise ConfigError(f"{FORMAT}: topic {self.topic} does not exist on {self.bootstrap}; "
                                  "create it (onceflow does not create data topics) or fix the topic option")
        if self.mode != "exactly_once":
            return
        if self.skip_probe:
            self._warn_unverified()
        else:
            result = cached_probe(self.bootstrap, min(self.timeout, 20), self.conf)
            if not result.ok:
                raise ConfigError(
                    f"{FORMAT}: refusing mode exactly_once: {result.detail}. Use a broker whose "
                    "read_committed hides aborted transactions, or choose mode=\"at_least_once\" "
                    "explicitly (duplicates possible after failures); 'onceflow doctor --kafka "
                    f"{self.bootstrap}' shows the checks")
        _ensure_topic(self.conf, self.marker_topic, min(self.timeout, 15))

    def _warn_unverified(self) -> None:
        """skip_broker_probe: say loudly, in the log and the job's event log, what is not known."""
        detail = (f"skip_broker_probe=true: the broker at {self.bootstrap} was NOT checked for hiding "
                  "aborted transactional records; exactly-once for read_committed consumers is "
                  "not verified (a broker that shows aborted records shows duplicates after retries)")
        log.warning("%s: %s", FORMAT, detail)
        loc = self.opts.get("checkpointlocation")
        if loc:
            from onceflow.checkpoint.eventlog import EventLog

            try:
                EventLog(loc).append("guarantee_unverified", sink=FORMAT, sink_id=self.sink_id,
                                     mode=self.mode, detail=detail)
            except OSError as e:
                log.warning("could not append to the event log: %s", e)

    # ---- tasks ---------------------------------------------------------------------------

    def is_decided(self, lineage: str, batch_id: int) -> bool:
        """Task, first step: fence this partition's older attempts, then read the markers.

        Fencing comes first: an older attempt that died between producing its marker and
        committing left a transaction open on the marker partition, and a read_committed read
        would wait for it until ``transaction.timeout.ms``.
        """
        if self.mode != "exactly_once":
            return False
        task = TaskInfo.current()
        txn = self.txn_id(lineage, task.partition)
        _transactional_producer(self.conf, txn, self.timeout, fresh=True)  # init_transactions fences
        _FENCED[txn] = (task.batch_id, task.attempt)
        return (self.sink_id, lineage, batch_id) in self._refreshed(lineage, {txn}).decisions

    def _refreshed(self, lineage: str, own: set[str]) -> MarkerLog:
        """The lineage's markers, read to the log end. A transaction that still holds the marker
        partition after a grace period belongs to a dead task of another partition (live tasks
        produce their marker last and commit right after): fence it instead of waiting up to
        the timeout (a live but slow one then fails its commit and is retried, nothing is lost).
        With ``fence_stale`` False (restore checks, which may run beside a live job of the same
        lineage) nothing is fenced: the read waits up to the timeout. If the open transactions
        cannot be listed or fenced, the read also just waits; after the timeout it raises
        :class:`MarkerWait` (a :class:`SinkError`) naming the marker partition."""
        from confluent_kafka import KafkaException

        markers = self._markers(lineage)
        if not self.fence_stale:
            return markers.refresh(wait=self.timeout)
        try:
            return markers.refresh(wait=min(5.0, self.timeout / 4))
        except MarkerWait:
            try:
                stale = markers.uncommitted_txn_ids(self.sink_id, lineage) - own - {self.txn_id(lineage, "driver")}
            except KafkaException as e:
                log.warning("%s: cannot list the transactions open on marker topic %s (%s); waiting "
                            "for them instead", FORMAT, self.marker_topic, e.args[0])
                stale = set()
            for txn in sorted(stale):
                log.warning("%s: fencing transaction %s, open on the marker topic for too long", FORMAT, txn)
                try:
                    _transactional_producer(self.conf, txn, self.timeout, fresh=True)
                except SinkError as e:
                    log.warning("%s: %s; waiting for the transaction instead", FORMAT, e)
                _drop_producer(txn)
            return markers.refresh(wait=self.timeout)

    def pre_commit(self, task: TaskInfo, schema: StructType, overwrite: bool, batches: Iterator):
        if self.mode != "exactly_once":
            return self._write_at_least_once(task, schema, batches)
        txn = self.txn_id(task.lineage, task.partition)
        # A producer initialised by this very task attempt (in is_decided), never an older
        # cached one: init_transactions fenced every older attempt of this partition.
        fresh = _FENCED.pop(txn, None) != (task.batch_id, task.attempt)
        producer = _transactional_producer(self.conf, txn, self.timeout, fresh=fresh)
        try:
            return self._pre_commit_txn(task, schema, producer, txn, batches)
        finally:
            _drop_producer(txn)

    def _pre_commit_txn(self, task: TaskInfo, schema: StructType, producer, txn: str, batches: Iterator):
        fingerprint = _task_fingerprint(self.opts.get("checkpointlocation"), task.batch_id)
        done = self._refreshed(task.lineage, {txn}).parts.get(
            (self.sink_id, task.lineage, task.batch_id, task.partition))
        if done is not None:
            _check_fingerprint(done.get("fingerprint", "unknown"), fingerprint, task, self.sink_id)
            for _ in batches:  # drain: upstream state commits only when the input is consumed
                pass
            log.info("%s: batch %d partition %d already committed by attempt %s; skipped",
                     FORMAT, task.batch_id, task.partition, done.get("attempt"))
            return {"partition": task.partition, "attempt": done.get("attempt"),
                    "rows": done.get("rows"), "reused": True}, 0
        from confluent_kafka import KafkaException

        try:
            producer.begin_transaction()
            rows, errors = self._produce(producer, schema, batches)
            producer.flush(self.timeout)
            if errors:
                raise SinkError(f"{FORMAT}: batch {task.batch_id} partition {task.partition}: "
                                f"{len(errors)} record(s) not delivered, first: {errors[0]}")
            marker = {"type": "partition", "sink": self.sink_id, "lineage": task.lineage,
                      "batch": task.batch_id, "partition": task.partition, "attempt": task.attempt,
                      "rows": rows, "fingerprint": fingerprint, "txn": txn}
            key = self.marker_key(task.lineage)
            n = _marker_partitions(self.conf, self.marker_topic, self.timeout)
            producer.produce(self.marker_topic, json.dumps(marker).encode(), key.encode(),
                             partition=marker_partition(key, n))
            producer.commit_transaction(self.timeout)
        except (KafkaException, SinkError) as e:
            _abort_quietly(producer, txn, self.timeout)
            if isinstance(e, SinkError):
                raise
            raise SinkError(f"{FORMAT}: transaction {txn} (batch {task.batch_id}) failed: "
                            f"{e.args[0].str()}") from None
        except BaseException:
            _abort_quietly(producer, txn, self.timeout)
            raise
        handle = {"partition": task.partition, "attempt": task.attempt, "rows": rows, "reused": False}
        return handle, rows

    def _produce(self, producer, schema: StructType, batches: Iterator) -> tuple[int, list[str]]:
        names = [f.name for f in schema.fields]
        errors: list[str] = []

        def on_delivery(err, msg) -> None:
            if err is not None:
                errors.append(f"topic {msg.topic()}: {err.str()}")

        rows = 0
        has_key, has_topic = self.key_column in names, self.topic_column in names and self.topic is None
        has_part, has_headers = "partition" in names, "headers" in names
        for batch in batches:
            if not batch.num_rows:
                continue
            values = batch.column(names.index(self.value_column)).to_pylist()
            keys = batch.column(names.index(self.key_column)).to_pylist() if has_key else None
            topics = batch.column(names.index(self.topic_column)).to_pylist() if has_topic else None
            parts = batch.column(names.index("partition")).to_pylist() if has_part else None
            headers = batch.column(names.index("headers")).to_pylist() if has_headers else None
            for i, value in enumerate(values):
                topic = topics[i] if topics is not None else self.topic
                if topics is not None:
                    self._check_topic(producer, topic)
                kwargs: dict[str, Any] = {"value": value.encode() if isinstance(value, str) else value,
                                          "on_delivery": on_delivery}
                if keys is not None and keys[i] is not None:
                    kwargs["key"] = keys[i].encode() if isinstance(keys[i], str) else keys[i]
                if parts is not None and parts[i] is not None:
                    kwargs["partition"] = parts[i]
                if headers is not None and headers[i]:
                    kwargs["headers"] = [(h["key"], h["value"]) for h in headers[i]]
                while True:
                    try:
                        producer.produce(topic, **kwargs)
                        break
                    except BufferError:
                        producer.poll(0.05)
                rows += 1
            producer.poll(0)
        return rows, errors

    def _check_topic(self, producer, topic: str | None) -> None:
        """Per-row topics: fail fast naming an unknown topic (instead of a delivery timeout)."""
        if topic is None:
            raise SinkError(f"{FORMAT}: a row has a null {self.topic_column!r} and no topic option is set")
        key = (self.bootstrap, topic)
        if key not in _KNOWN_TOPICS:
            md = producer.list_topics(topic, timeout=min(self.timeout, 15)).topics.get(topic)
            if md is None or md.error is not None:
                raise SinkError(f"{FORMAT}: topic {topic} (from column {self.topic_column!r}) does not "
                                f"exist on {self.bootstrap}; create it or fix the column")
            _KNOWN_TOPICS[key] = True

    def _write_at_least_once(self, task: TaskInfo, schema: StructType, batches: Iterator):
        from confluent_kafka import Producer

        key = f"alo-{self.bootstrap}-{json.dumps(self.conf, sort_keys=True, default=str)}"
        producer = _PRODUCERS.get(key)
        if producer is None:
            producer = _PRODUCERS[key] = Producer(self.conf)
        rows, errors = self._produce(producer, schema, batches)
        left = producer.flush(self.timeout)
        if errors or left:
            raise SinkError(f"{FORMAT}: batch {task.batch_id} partition {task.partition}: "
                            f"{len(errors) + left} record(s) not delivered"
                            + (f", first: {errors[0]}" if errors else " (flush timed out)"))
        return {"partition": task.partition, "attempt": task.attempt, "rows": rows}, rows

    # ---- driver --------------------------------------------------------------------------

    def decision(self, lineage: str, batch_id: int) -> Decision | None:
        if self.mode != "exactly_once":
            return None
        d = self._refreshed(lineage, set()).decisions.get((self.sink_id, lineage, batch_id))
        if d is None:
            return None
        return Decision(lineage, batch_id, d.get("fingerprint", "unknown"), d.get("handles", []))

    def decide(self, decision: Decision, schema: StructType, overwrite: bool) -> None:
        if self.mode != "exactly_once":
            return
        from confluent_kafka import KafkaException

        txn = self.txn_id(decision.lineage, "driver")
        producer = _transactional_producer(self.conf, txn, self.timeout)
        key = self.marker_key(decision.lineage)
        n = _marker_partitions(self.conf, self.marker_topic, self.timeout)
        marker = {"type": "decision", "sink": self.sink_id, "lineage": decision.lineage,
                  "batch": decision.batch_id, "fingerprint": decision.fingerprint,
                  "handles": decision.handles, "txn": txn}
        try:
            producer.begin_transaction()
            producer.produce(self.marker_topic, json.dumps(marker).encode(), key.encode(),
                             partition=marker_partition(key, n))
            producer.commit_transaction(self.timeout)
        except KafkaException as e:
            _abort_quietly(producer, txn, self.timeout)
            raise SinkError(f"{FORMAT}: recording the decision for batch {decision.batch_id} failed "
                            f"({e.args[0].str()}); the batch is replayed after the restart and its "
                            "committed partitions are skipped") from None

    def commit(self, decision: Decision) -> None:
        """Nothing to do: each partition became visible when its task's transaction committed."""
        maybe_crash("mid_commit", decision.batch_id, None, self.opts)

    def abort(self, lineage: str, batch_id: int, handles: list[Any]) -> None:
        committed = sorted(h["partition"] for h in handles if h and not h.get("reused"))
        if committed and self.mode == "exactly_once":
            log.warning(
                "%s: batch %d of %s failed after partitions %s committed their Kafka transactions; "
                "they stay visible (Kafka cannot un-commit) and are skipped when the batch is replayed",
                FORMAT, batch_id, lineage, committed)

    def recover(self, lineage: str, in_flight: Sequence[Any] = ()) -> dict[str, int]:
        """Fence this lineage's driver id, and abort transactions left open by crashed tasks
        (they would hold the marker partition's last stable offset until they time out)."""
        if self.mode != "exactly_once":
            return {}
        from confluent_kafka import KafkaException

        _transactional_producer(self.conf, self.txn_id(lineage, "driver"), self.timeout, fresh=True)
        try:
            zombies = self._markers(lineage).uncommitted_txn_ids(self.sink_id, lineage)
        except KafkaException as e:
            log.warning("%s: could not look for open transactions of %s: %s", FORMAT, lineage, e)
            return {}
        live = {self.txn_id(lineage, h["partition"]) for h in in_flight if h}
        fenced = 0
        for txn in sorted(zombies - live - {self.txn_id(lineage, "driver")}):
            _transactional_producer(self.conf, txn, self.timeout, fresh=True)
            _drop_producer(txn)
            fenced += 1
        return {"open_transactions_aborted": fenced}


_MARKER_PARTS: dict[tuple[str, str], int] = {}


def _marker_partitions(conf: Mapping[str, Any], topic: str, timeout: float) -> int:
    key = (conf["bootstrap.servers"], topic)
    if key not in _MARKER_PARTS:
        md = _admin(conf).list_topics(topic, timeout=timeout).topics.get(topic)
        if md is None or md.error is not None or not md.partitions:
            raise SinkError(f"{FORMAT}: marker topic {topic} does not exist on {conf['bootstrap.servers']}")
        _MARKER_PARTS[key] = len(md.partitions)
    return _MARKER_PARTS[key]


def _abort_quietly(producer, txn: str, timeout: float) -> None:
    try:
        producer.abort_transaction(timeout)
    except Exception:  # noqa: BLE001 - fenced or broken: a fresh producer re-initialises
        _drop_producer(txn)


def _task_fingerprint(checkpoint: str | None, batch_id: int) -> str:
    """Batch N's fingerprint from ``offsets/N`` (tasks read the shared checkpoint), or 'unknown'."""
    if not checkpoint:
        return "unknown"
    try:
        from onceflow.checkpoint.layout import CheckpointDir

        return CheckpointDir(checkpoint).offsets(batch_id).fingerprint
    except Exception:  # noqa: BLE001 - executors without access to the checkpoint
        return "unknown"


def _check_fingerprint(stored: str, current: str, task: TaskInfo, sink_id: str) -> None:
    if stored != current and "unknown" not in (stored, current):
        raise FingerprintMismatch(
            f"{FORMAT}: sink {sink_id} batch {task.batch_id} partition {task.partition} of lineage "
            f"{task.lineage} was already committed from different source offsets (stored "
            f"fingerprint {stored}, this run {current}). The checkpoint was restored from an older "
            "savepoint or edited while keeping the lineage: restart with 'onceflow run "
            "--from-savepoint SP --fork' to get a new lineage.")


# ---- user-facing configuration -------------------------------------------------------------


@dataclass
class KafkaSink(Sink):
    """Kafka sink for a :class:`~onceflow.Job` (or ``writeStream``).

    Input rows carry ``value`` (binary/string), optionally ``key``, ``topic``, ``partition``
    and ``headers``, as for Spark's Kafka sink. ``mode``: ``exactly_once`` (default;
    transactional producer per (lineage, partition) + markers; refused on brokers whose
    read_committed shows aborted records) or ``at_least_once`` (explicit; no transactions).
    ``producer_config``: extra librdkafka properties (security, compression, ...).
    """

    bootstrap_servers: str
    topic: str | None = None
    key_column: str = "key"
    value_column: str = "value"
    topic_column: str = "topic"
    mode: Literal["exactly_once", "at_least_once"] = "exactly_once"
    producer_config: Mapping[str, Any] = field(default_factory=dict)
    sink_id: str = "kafka"
    marker_topic: str = MARKER_TOPIC
    timeout: float = 60.0

    format_name = FORMAT

    def options(self) -> dict[str, str]:
        opts = {
            "bootstrap_servers": self.bootstrap_servers, "key_column": self.key_column,
            "value_column": self.value_column, "topic_column": self.topic_column,
            "mode": self.mode, "sink_id": self.sink_id, "marker_topic": self.marker_topic,
            "timeout": str(self.timeout),
        }
        if self.topic:
            opts["topic"] = self.topic
        if self.producer_config:
            opts["producer_config"] = json.dumps(dict(self.producer_config))
        return opts


__all__ = ["FORMAT", "KafkaDataSource", "KafkaSink", "ProbeResult", "CheckResult", "probe", "doctor",
           "MarkerLog", "GUARANTEES"]
