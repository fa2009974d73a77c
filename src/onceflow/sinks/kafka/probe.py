"""The broker probe that gates mode exactly_once, and the checks of ``onceflow doctor --kafka``.

Guarantees:
- :func:`probe` answers one question by experiment, not by version strings: does a
  ``read_committed`` consumer of this broker see a record of an aborted transaction? Only a
  broker that hides it gets ``ok``; the sink refuses exactly_once otherwise. An unreachable
  broker raises SinkError; every other outcome is a result.
- :func:`cached_probe` runs it once per (bootstrap, producer configuration) per process.
- Bypassing it (``skip_broker_probe``, tests only) is never silent: :func:`warn_unverified`
  logs a WARNING and appends ``guarantee_unverified`` to the job's event log.
- :func:`doctor` never raises for an unreachable or partial broker: each check is a line. A
  check that cannot be made because the broker does not report a setting (tansu reports no
  broker configuration) says so and does not fail.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from onceflow.errors import OnceflowError
from onceflow.kafka_client import broker_config, conf_key, consumer_conf, error_text, topic_config
from onceflow.sinks.kafka.common import (
    DEFAULT_TRANSACTION_TIMEOUT,
    FORMAT,
    GUARANTEES,
    MARKER_TOPIC,
    PROBE_TOPIC,
    ensure_topic,
    reachable,
    replication_for,
)
from onceflow.sinks.kafka.markers import MARKER_TOPIC_CONFIG

log = logging.getLogger("onceflow.sinks.kafka")


@dataclass(frozen=True)
class ProbeResult:
    """Whether the broker hides aborted transactional records from read_committed consumers."""

    ok: bool
    detail: str


@dataclass(frozen=True)
class CheckResult:
    """One ``onceflow doctor --kafka`` check (same shape as the PostgreSQL doctor's).

    ``warning``: passed, but the detail says what to change (printed as ``warn``)."""

    name: str
    ok: bool
    detail: str
    warning: bool = False


_PROBES: dict[tuple[str, str], ProbeResult] = {}
_PROBE_LOCK = threading.Lock()


def probe(bootstrap: str, timeout: float = 20.0, producer_config: Mapping[str, Any] | None = None,
          topic: str = PROBE_TOPIC) -> ProbeResult:
    """Produce one record in an aborted transaction and one in a committed transaction to
    ``topic``, read them back with ``read_committed``: ok when only the committed one is seen.

    Raises SinkError when the broker cannot be reached; every other outcome is a result.
    """
    from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

    conf = {**(producer_config or {}), "bootstrap.servers": bootstrap}
    reachable(conf, timeout)
    ensure_topic(conf, topic, timeout)
    tag = uuid.uuid4().hex
    aborted, committed = f"aborted-{tag}".encode(), f"committed-{tag}".encode()
    wm = Consumer({**consumer_conf(conf), "group.id": f"onceflow-probe-{tag}", "isolation.level": "read_uncommitted"})
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
        return ProbeResult(False, f"transactions do not work on {bootstrap}: {error_text(e, conf)}; "
                                  "exactly_once needs transactions (Kafka 0.11+, transaction state log)")
    consumer = Consumer({**consumer_conf(conf), "group.id": f"onceflow-probe-{tag}", "isolation.level": "read_committed",
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
    key = (bootstrap, conf_key(producer_config or {}))
    with _PROBE_LOCK:
        if key not in _PROBES:
            _PROBES[key] = probe(bootstrap, timeout, producer_config)
        return _PROBES[key]


def warn_unverified(bootstrap: str, sink_id: str, mode: str, checkpoint: str | None) -> None:
    """skip_broker_probe: say loudly, in the log and the job's event log, what is not known."""
    detail = (f"skip_broker_probe=true: the broker at {bootstrap} was NOT checked for hiding "
              "aborted transactional records; exactly-once for read_committed consumers is "
              "not verified (a broker that shows aborted records shows duplicates after retries)")
    log.warning("%s: %s", FORMAT, detail)
    if checkpoint:
        from onceflow.checkpoint.eventlog import EventLog

        try:
            EventLog(checkpoint).append("guarantee_unverified", sink=FORMAT, sink_id=sink_id,
                                        mode=mode, detail=detail)
        except OSError as e:
            log.warning("could not append to the event log: %s", e)


def transaction_timeout_check(conf: Mapping[str, Any], transaction_timeout: float, timeout: float) -> CheckResult:
    """``transaction_timeout`` against the broker's ``transaction.max.timeout.ms``."""
    ms = int(transaction_timeout * 1000)
    reported = broker_config(conf, "transaction.max.timeout.ms", timeout)
    if reported is None or not reported.strip().lstrip("-").isdigit():
        return CheckResult("transaction_timeout", True, (
            f"transaction_timeout={transaction_timeout:g}s (transaction.timeout.ms={ms}): the broker "
            "does not report transaction.max.timeout.ms (DescribeConfigs gave no value; tansu does "
            "not report broker settings), so it cannot be checked here; Apache Kafka's default "
            "maximum is 900000 ms. Each task must produce its partition within transaction_timeout"))
    limit = int(reported)
    if ms > limit:
        return CheckResult("transaction_timeout", False, (
            f"transaction_timeout={transaction_timeout:g}s (transaction.timeout.ms={ms}) exceeds the "
            f"broker's transaction.max.timeout.ms={limit}: every transactional producer would be "
            "refused; lower transaction_timeout or raise transaction.max.timeout.ms on the brokers"))
    return CheckResult("transaction_timeout", True, (
        f"transaction_timeout={transaction_timeout:g}s (transaction.timeout.ms={ms}) is within the "
        f"broker's transaction.max.timeout.ms={limit}; each task must produce its partition within it"))


def marker_topic_check(conf: Mapping[str, Any], md, topic: str, timeout: float) -> CheckResult:
    """The marker topic's cleanup policy (compact: markers are never deleted by age) and
    replication (a single replica loses every decision and epoch with its broker)."""
    brokers = len(md.brokers)
    wanted = replication_for(md)
    found = md.topics.get(topic)
    if found is None or found.error is not None or not found.partitions:
        return CheckResult("marker_topic", True, (
            f"{topic} missing; created with 1 partition, cleanup.policy="
            f"{MARKER_TOPIC_CONFIG['cleanup.policy']} and replication {wanted} (min(3, {brokers} "
            "broker(s))) when the first exactly_once query starts"))
    replicas = min(len(p.replicas) for p in found.partitions.values())
    parts = [f"{topic}: {len(found.partitions)} partition(s), replication {replicas}"]
    ok, warning = True, False
    cfg = topic_config(conf, topic, timeout)
    policy = (cfg or {}).get("cleanup.policy")
    retention = (cfg or {}).get("retention.ms")
    if policy is None:
        parts.append("cleanup.policy not reported by the broker (should be compact)")
    elif "delete" in policy and retention not in (None, "-1"):
        ok = False
        parts.append(
            f"cleanup.policy={policy} with retention.ms={retention}: markers older than that are "
            "deleted, so a lineage idle that long loses its epochs (fencing of paused drivers) and "
            "decisions (replay checks); set cleanup.policy=compact on the topic")
    elif "compact" in policy:
        parts.append(f"cleanup.policy={policy}")
    else:
        parts.append(f"cleanup.policy={policy} (retention.ms={retention}: never deleted by age; "
                     "compact is recommended)")
    if replicas < wanted:
        warning = True
        parts.append(
            f"WARNING: {replicas} replica(s) on a cluster of {brokers} brokers: losing a broker "
            f"can lose the decisions and epochs; raise the replication to {wanted}")
    elif replicas == 1:
        parts.append("one replica: fine for this single-broker cluster, not for production")
    return CheckResult("marker_topic", ok, "; ".join(parts), warning)


def doctor(bootstrap: str, timeout: float = 20.0,
           transaction_timeout: float = DEFAULT_TRANSACTION_TIMEOUT,
           marker_topic: str = MARKER_TOPIC,
           producer_config: Mapping[str, Any] | None = None) -> list[CheckResult]:
    """Checks for ``onceflow doctor --kafka``: reachability, transactions / aborted-record
    filtering (the probe), the transaction timeout against the broker's maximum, the marker
    topic (cleanup policy, replication), and the guarantee each mode gives on this broker."""
    conf = {**(producer_config or {}), "bootstrap.servers": bootstrap}
    try:
        md = reachable(conf, timeout)
    except OnceflowError as e:
        return [CheckResult("reachable", False, str(e))]
    results = [CheckResult("reachable", True, f"{bootstrap}: {len(md.brokers)} broker(s), {len(md.topics)} topic(s)")]
    try:
        result = probe(bootstrap, timeout, producer_config)
    except OnceflowError as e:
        result = ProbeResult(False, str(e))
    results.append(CheckResult("aborted_records_hidden", result.ok, result.detail))
    results.append(transaction_timeout_check(conf, transaction_timeout, timeout))
    results.append(marker_topic_check(conf, md, marker_topic, timeout))
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
