"""confluent-kafka plumbing shared by the Kafka source and the Kafka sink.

Guarantees:
- :func:`consumer_conf` / :func:`admin_conf` derive a consumer's or an admin client's
  configuration from a user's producer or consumer configuration: properties of the other
  client kind are dropped (librdkafka would warn about each), every connection and security
  property (``bootstrap.servers``, ``security.protocol``, ``ssl.*``, ``sasl.*``, ...) is kept,
  so one set of credentials serves every client onceflow creates.
- Secrets never reach a message or a log line through these helpers: :func:`redact` masks the
  values of secret properties (passwords, keys, JAAS configs, OAuth secrets) in a
  configuration, and :func:`error_text` turns a Kafka exception into one line with any secret
  value of the configuration it was given replaced by ``***``.
- :func:`broker_config` and :func:`topic_config` never raise: a broker that does not answer
  DescribeConfigs, or does not report a property, gives None ("not reported").

confluent-kafka is imported lazily: it is an optional dependency (extra ``kafka``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

#: Property prefixes that only producers understand.
PRODUCER_ONLY = ("transaction", "enable.idempotence", "linger", "batch", "partitioner", "acks",
                 "compression", "queue.buffering", "message.timeout", "delivery.timeout",
                 "retries", "max.in.flight", "sticky", "message.send", "request.required.acks")
#: Property prefixes that only consumers understand.
CONSUMER_ONLY = ("isolation.level", "group.", "enable.auto.", "auto.", "enable.partition.eof",
                 "fetch.", "max.partition.fetch", "session.timeout", "heartbeat",
                 "partition.assignment", "queued.", "check.crcs", "max.poll")
#: Substrings of property names whose values are secrets.
SECRET_MARKERS = ("password", "secret", "jaas", "ssl.key.pem", "ssl_key", "token", "credential")


def is_secret(name: str) -> bool:
    return any(m in name.lower() for m in SECRET_MARKERS)


def redact(conf: Mapping[str, Any]) -> dict[str, Any]:
    """``conf`` with the value of every secret property replaced by ``***``."""
    return {k: ("***" if is_secret(str(k)) else v) for k, v in conf.items()}


def conf_key(conf: Mapping[str, Any]) -> str:
    """A stable string for caching per configuration (never printed: it holds secrets)."""
    return json.dumps(dict(conf), sort_keys=True, default=str)


def consumer_conf(conf: Mapping[str, Any]) -> dict[str, Any]:
    """A consumer's configuration from a producer's: producer-only properties dropped."""
    return {k: v for k, v in conf.items() if not str(k).startswith(PRODUCER_ONLY)}


def admin_conf(conf: Mapping[str, Any]) -> dict[str, Any]:
    """An admin client's configuration: producer-only and consumer-only properties dropped."""
    return {k: v for k, v in conf.items() if not str(k).startswith(PRODUCER_ONLY + CONSUMER_ONLY)}


def admin_client(conf: Mapping[str, Any], quiet: bool = True):
    """An AdminClient for ``conf``. ``quiet``: librdkafka's own log off (``log_level`` 0);
    failures still surface as exceptions carrying the cause, without reconnect spam."""
    from confluent_kafka.admin import AdminClient

    return AdminClient({**({"log_level": 0} if quiet else {}), **admin_conf(conf)})


def error_text(exc: BaseException, conf: Mapping[str, Any] | None = None) -> str:
    """One line describing a KafkaException (or any exception), secrets of ``conf`` masked."""
    arg = exc.args[0] if exc.args else exc
    text = arg.str() if hasattr(arg, "str") else str(arg)
    for k, v in (conf or {}).items():
        if is_secret(str(k)) and v and str(v) in text:
            text = text.replace(str(v), "***")
    return " ".join(text.split())


def is_fenced(exc: BaseException) -> bool:
    """True when a KafkaException says that a newer producer with the same transactional id
    fenced this one (_FENCED, PRODUCER_FENCED or INVALID_PRODUCER_EPOCH)."""
    from confluent_kafka import KafkaError

    err = exc.args[0] if exc.args else None
    code = err.code() if hasattr(err, "code") else None
    return code in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH)


def broker_config(conf: Mapping[str, Any], name: str, timeout: float) -> str | None:
    """Property ``name`` as a broker of the cluster reports it, or None when it does not."""
    from confluent_kafka.admin import ConfigResource, ResourceType

    try:
        admin = admin_client(conf)
        brokers = sorted(admin.list_topics(timeout=timeout).brokers)
        for broker in brokers[:1]:
            futures = admin.describe_configs([ConfigResource(ResourceType.BROKER, str(broker))],
                                             request_timeout=timeout)
            for fut in futures.values():
                entry = fut.result(timeout).get(name)
                if entry is not None and entry.value is not None:
                    return str(entry.value)
    except Exception:  # noqa: BLE001 - not reported (unsupported request, no ACL, timeout)
        return None
    return None


def topic_config(conf: Mapping[str, Any], topic: str, timeout: float) -> dict[str, str] | None:
    """The configuration of ``topic`` as the broker reports it ({} or None: not reported)."""
    from confluent_kafka.admin import ConfigResource, ResourceType

    try:
        admin = admin_client(conf)
        futures = admin.describe_configs([ConfigResource(ResourceType.TOPIC, topic)],
                                         request_timeout=timeout)
        for fut in futures.values():
            return {n: str(e.value) for n, e in fut.result(timeout).items() if e.value is not None}
    except Exception:  # noqa: BLE001 - not reported
        return None
    return None
