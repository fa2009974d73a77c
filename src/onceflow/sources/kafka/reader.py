"""The Kafka source's stream reader: planning offset ranges, data loss, commits."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    StructType,
)

from onceflow.sources.initial import kept_initial
from onceflow.sources.kafka.cluster import KafkaCluster
from onceflow.sources.kafka.fetch import (
    KafkaInputPartition,
    read_range,
    record_data_loss,
)
from onceflow.sources.kafka.options import (
    NAME,
    KafkaDataLossError,
    Offsets,
    Settings,
    TopicPartitionKey,
    cap_offsets,
    check_starting_partitions,
    from_json,
    to_json,
)

log = logging.getLogger("onceflow.sources.kafka")


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
        """Where a new query starts. With ``eventLog`` (the checkpoint, set by onceflow Jobs)
        the first answer is kept there (:func:`onceflow.sources.initial.kept_initial`), so a
        replayed batch 0 reads the same range even for 'latest'."""
        return kept_initial(self._initial_path(), self._identity(), self._initial, NAME)

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


