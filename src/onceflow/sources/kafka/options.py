"""Options of the Kafka source: parsing, validation and the offset JSON Spark checkpoints."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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


