"""Names, guarantees and cluster look-ups shared by the Kafka sink's modules.

Guarantees: an unreachable cluster is always a :class:`~onceflow.errors.SinkError` (an outage
the restart strategy waits out) with a one-line message naming the bootstrap servers; a
producer configuration librdkafka rejects is a :class:`~onceflow.errors.ConfigError`.
:func:`ensure_topic` creates a missing topic with the replication the cluster allows
(``min(3, brokers)``) and the given configuration, and never alters an existing topic.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception_type,
    retry_if_result,
    stop_after_attempt,
    stop_after_delay,
    wait_fixed,
    wait_random,
)

from onceflow.errors import ConfigError, SinkError
from onceflow.kafka_client import admin_client, error_text

FORMAT = "onceflow-kafka-sink"
MARKER_TOPIC = "__onceflow_markers"
PROBE_TOPIC = "__onceflow_probe"
MODES = ("exactly_once", "at_least_once")
#: Default of the ``transaction_timeout`` option (seconds).
DEFAULT_TRANSACTION_TIMEOUT = 60.0

GUARANTEES = {
    "exactly_once": (
        "exactly-once for read_committed consumers: each partition of a batch is committed in one "
        "Kafka transaction with its marker and skipped on replay; a batch becomes visible "
        "partition by partition (not atomically); decisions are fenced by driver epochs; needs "
        "a broker that hides aborted records"
    ),
    "at_least_once": (
        "at-least-once (explicit): idempotent producer without transactions; a replayed batch "
        "writes its rows again, consumers must deduplicate"
    ),
}


def seconds_option(opts: Mapping[str, str], name: str, default: float) -> float:
    """Option ``name`` as a positive number of seconds (``default`` when not given)."""
    raw = opts.get(name)
    try:
        value = float(raw) if raw not in (None, "") else default
    except ValueError:
        raise ConfigError(f"{FORMAT}: {name}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ConfigError(f"{FORMAT}: {name}={raw!r} must be more than 0 seconds")
    return value


def unreachable(conf: Mapping[str, Any], timeout: float, exc: BaseException) -> SinkError:
    return SinkError(
        f"{FORMAT}: cannot reach Kafka at {conf['bootstrap.servers']} within {timeout:g}s "
        f"({error_text(exc, conf)}); check bootstrap_servers and that the brokers are up"
    )


def reachable(conf: Mapping[str, Any], timeout: float):
    """Cluster metadata; SinkError when the cluster cannot be reached, ConfigError when
    librdkafka rejects the configuration."""
    from confluent_kafka import KafkaException

    try:
        return admin_client(conf).list_topics(timeout=timeout)
    except KafkaException as e:
        raise unreachable(conf, timeout, e) from None
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{FORMAT}: invalid producer_config: {error_text(e, conf)}; see "
                          "librdkafka's CONFIGURATION.md") from None


def replication_for(md) -> int:
    """Replication factor for topics onceflow creates: min(3, number of brokers)."""
    return max(1, min(3, len(md.brokers)))


def ensure_topic(conf: Mapping[str, Any], topic: str, timeout: float,
                 config: Mapping[str, str] | None = None) -> int:
    """Create ``topic`` (1 partition, replication ``min(3, brokers)``, ``config``) unless it
    exists; return its partition count. An existing topic is used as it is."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import NewTopic

    md = reachable(conf, timeout)
    found = md.topics.get(topic)
    if found is not None and found.error is None and found.partitions:
        return len(found.partitions)
    replication = replication_for(md)
    settings = dict(config or {})
    if replication >= 3:
        settings.setdefault("min.insync.replicas", "2")
    admin = admin_client(conf)
    try:
        for fut in admin.create_topics([NewTopic(topic, 1, replication, config=settings)],
                                       request_timeout=timeout).values():
            fut.result(timeout)
    except KafkaException as e:
        code = e.args[0].code()
        if code != KafkaError.TOPIC_ALREADY_EXISTS:
            refused = code in (KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED,
                               KafkaError.POLICY_VIOLATION, KafkaError.INVALID_CONFIG,
                               KafkaError.INVALID_REPLICATION_FACTOR)
            raise (ConfigError if refused else SinkError)(
                f"{FORMAT}: topic {topic} does not exist on {conf['bootstrap.servers']} and could "
                f"not be created ({error_text(e, conf)}); create it (1 partition"
                + (", " + ", ".join(f"{k}={v}" for k, v in sorted(settings.items())) if settings else "")
                + ") or grant CreateTopics"
            ) from None

    def partitions() -> int | None:
        try:
            md = admin.list_topics(topic, timeout=timeout).topics.get(topic)
        except KafkaException as e:
            raise unreachable(conf, timeout, e) from None
        return len(md.partitions) if md is not None and md.error is None and md.partitions else None

    try:  # a created topic shows up in the metadata a moment later
        return Retrying(stop=stop_after_delay(timeout), wait=wait_fixed(0.1),
                        retry=retry_if_result(lambda n: n is None), reraise=True)(partitions)
    except RetryError:
        pass
    raise SinkError(f"{FORMAT}: topic {topic} did not appear on {conf['bootstrap.servers']} within {timeout:g}s")


#: attempts at a driver step whose producer another process of the same driver initialised
FENCE_RETRIES = 4


class Refenced(Exception):
    """This driver's producer was initialised by another process of the same driver (no newer
    epoch exists): the step is tried again with a fresh producer."""


def fence_retries() -> Retrying:
    """Up to :data:`FENCE_RETRIES` attempts of a step that raises :class:`Refenced`, a random
    50-500 ms apart; the last Refenced is raised to the caller."""
    return Retrying(stop=stop_after_attempt(FENCE_RETRIES), wait=wait_random(0.05, 0.5),
                    retry=retry_if_exception_type(Refenced), reraise=True)
