"""Driver-side Kafka metadata and offset look-ups of the Kafka source."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from onceflow.errors import SourceError
from onceflow.kafka_client import admin_client, error_text
from onceflow.sources.kafka.options import (
    NAME,
    Offsets,
    Settings,
    TopicPartitionKey,
    _fail,
)

log = logging.getLogger("onceflow.sources.kafka")


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
            raise SourceError(f"{NAME}: cannot reach Kafka at {self.s.bootstrap} within {timeout:g}s "
                              f"({error_text(e, self.s.consumer_conf)}); check kafka.bootstrap.servers "
                              "and that the brokers are up (the restart strategy retries)") from None
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
            raise SourceError(f"{NAME}: listing {spec} offsets on {self.s.bootstrap} failed: "
                                f"{error_text(e, self.s.consumer_conf)}; the query will be restarted "
                                "by its restart strategy") from None


