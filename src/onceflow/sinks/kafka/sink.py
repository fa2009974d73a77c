"""The Kafka sink's Spark data source (``onceflow-kafka-sink``) and its user-facing config.

Guarantees (mode ``exactly_once``; see the package docstring for the whole scheme):
- A task commits its partition's rows and its partition marker in one Kafka transaction under
  the stable id ``onceflow-<sink_id>-<lineage>-p<p>``, after fencing every older attempt of
  that partition; a replay skips a partition whose marker is committed.
- A task whose driver epoch (the ``epoch`` option) is older than the latest epoch marker of
  its lineage raises FencedError before it produces anything.
- :meth:`KafkaSinkDataSource.acquire_epoch` fences every older driver producer of the lineage
  (``init_transactions`` on ``onceflow-<sink_id>-<lineage>-driver``) and commits an epoch
  marker one higher than any before.
- :meth:`KafkaSinkDataSource.decide` records a decision only in a transaction of that driver
  producer, after reading (once that producer was initialised) that no newer epoch exists and
  that the batch is undecided or decided with this very decision. Otherwise, or when the
  producer turns out fenced and a newer epoch exists, it raises FencedError and writes nothing.
- An unreachable cluster is a SinkError, a wrong option a ConfigError.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pyspark.sql.types import BinaryType, IntegerType, StringType, StructType

from onceflow.checkpoint.layout import CheckpointDir
from onceflow.errors import ConfigError, FencedError, OnceflowError, SinkError
from onceflow.faults import maybe_crash
from onceflow.kafka_client import broker_config, error_text, is_fenced
from onceflow.sinks.base import Decision, TaskInfo, TwoPhaseCommitSink, fenced
from onceflow.sinks.kafka import producers as P
from onceflow.sinks.kafka.common import (
    DEFAULT_TRANSACTION_TIMEOUT,
    FENCE_RETRIES,
    FORMAT,
    GUARANTEES,
    MARKER_TOPIC,
    MODES,
    Refenced,
    fence_retries,
    reachable,
    seconds_option,
)
from onceflow.sinks.kafka.config import OPTIONS_DOC
from onceflow.sinks.kafka.markers import (
    MarkerLog,
    MarkerWait,
    decision_key,
    ensure_marker_topic,
    epoch_key,
    marker_partition,
    marker_partitions,
    partition_key,
    routing_key,
)
from onceflow.sinks.kafka.probe import cached_probe, warn_unverified
from onceflow.sinks.kafka.start import DEFAULT_STEP, advance_start, read_start
from onceflow.sinks.kafka.turns import serialize
from onceflow.sinks.replay import ContentDigest, check_replay, task_fingerprint

log = logging.getLogger("onceflow.sinks.kafka")

#: How often a driver step re-initialises its producer after being fenced with no newer
#: epoch in the marker log (another process of the same driver initialised the id).


class KafkaSinkDataSource(TwoPhaseCommitSink):
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
    options_doc = OPTIONS_DOC

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
        step = str(o.get("marker_start_step", DEFAULT_STEP))
        if not step.isdigit():
            raise ConfigError(f"{FORMAT}: marker_start_step={step!r}: give a number of offsets >= 0")
        self.start_step = int(step)
        if o.get("marker_partitions") and not str(o["marker_partitions"]).isdigit():
            raise ConfigError(f"{FORMAT}: marker_partitions={o['marker_partitions']!r}: give a "
                              "partition count >= 1")
        self.skip_probe = o.get("skip_broker_probe", "false").lower() in ("true", "1", "yes")
        if self.mode not in MODES:
            raise ConfigError(f"{FORMAT}: mode={self.mode!r}; use 'exactly_once' or 'at_least_once'")
        serial = o.get("serialize_commits", "auto").lower()
        if serial not in ("auto", "true", "false"):
            raise ConfigError(f"{FORMAT}: serialize_commits={serial!r}; use 'auto', 'true' or 'false'")
        self.serialized = self.mode == "exactly_once" and (
            serial == "true" or (serial == "auto" and self.skip_probe))
        if self.serialized:
            serialize(self.bootstrap)
        self.timeout = seconds_option(o, "timeout", 60.0)
        try:
            extra = json.loads(o.get("producer_config") or "{}")
        except ValueError as e:
            raise ConfigError(f"{FORMAT}: producer_config is not a JSON object: {e}") from None
        if not isinstance(extra, dict):
            raise ConfigError(f"{FORMAT}: producer_config must be a JSON object of librdkafka properties")
        for bad in ("transactional.id", "enable.idempotence", "bootstrap.servers"):
            if bad in extra:
                raise ConfigError(f"{FORMAT}: producer_config must not set {bad}; onceflow sets it")
        self.transaction_timeout = seconds_option(o, "transaction_timeout", DEFAULT_TRANSACTION_TIMEOUT)
        legacy = extra.pop("transaction.timeout.ms", None)
        if legacy is not None:  # accepted as before when the option itself is not given
            try:
                legacy_s = int(legacy) / 1000
            except (TypeError, ValueError):
                raise ConfigError(f"{FORMAT}: transaction.timeout.ms={legacy!r} is not a number") from None
            if o.get("transaction_timeout") and legacy_s != self.transaction_timeout:
                raise ConfigError(f"{FORMAT}: transaction_timeout={o['transaction_timeout']} and "
                                  f"producer_config's transaction.timeout.ms={legacy} differ; set "
                                  "transaction_timeout only")
            self.transaction_timeout = legacy_s
        # murmur2_random: same key -> partition mapping as Java clients and Spark's Kafka sink.
        self.conf: dict[str, Any] = {
            "partitioner": "murmur2_random", "linger.ms": 5,
            **{str(k): v for k, v in extra.items()},
            "bootstrap.servers": self.bootstrap, "enable.idempotence": True,
        }
        if self.mode == "exactly_once":
            self.conf["transaction.timeout.ms"] = int(self.transaction_timeout * 1000)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled in a Spark Python worker (the writer ships the sink there): the ends of its
        task transactions take turns as the driver's do (``__init__`` does not run there)."""
        self.__dict__.update(state)
        if state.get("serialized"):
            serialize(self.bootstrap)

    def __repr__(self) -> str:
        return f"KafkaSinkDataSource({self.bootstrap}, topic={self.topic}, mode={self.mode}, sink_id={self.sink_id})"

    def describe_guarantee(self) -> str:
        if self.mode == "exactly_once" and self.skip_probe:
            return (f"{GUARANTEES[self.mode]}; NOT VERIFIED: skip_broker_probe=true bypassed the check "
                    "that the broker hides aborted records")
        return GUARANTEES[self.mode]

    # ---- names ---------------------------------------------------------------------------

    def txn_id(self, lineage: str, partition: int | str) -> str:
        return f"onceflow-{self.sink_id}-{lineage}-p{partition}"

    def driver_txn_id(self, lineage: str) -> str:
        return f"onceflow-{self.sink_id}-{lineage}-driver"

    def marker_key(self, lineage: str) -> str:
        """Chooses the marker partition of the lineage (see markers.py for record keys)."""
        return routing_key(self.sink_id, lineage)

    def _marker_count(self) -> int:
        """The partition count that routes markers: ``marker_partitions``, else the topic's."""
        pinned = self.opts.get("marker_partitions")
        return int(pinned) if pinned else marker_partitions(self.conf, self.marker_topic, self.timeout)

    def _markers(self, lineage: str) -> MarkerLog:
        """This process's reader of the lineage's markers, from the start the checkpoint records."""
        part = marker_partition(self.marker_key(lineage), self._marker_count())
        loc = self.opts.get("checkpointlocation")
        origin = None if not self.fence_stale else (  # restore checks read every marker
            lambda: read_start(loc, self.sink_id, lineage, self.marker_topic, part))
        return MarkerLog.get(self.conf, self.marker_topic, part, self.timeout, self.sink_id, lineage, origin)

    def _produce_marker(self, producer, lineage: str, key: str, marker: dict) -> None:
        producer.produce(self.marker_topic, json.dumps(marker).encode(), key.encode(),
                         partition=marker_partition(self.marker_key(lineage), self._marker_count()))

    def _markers_moved(self, lineage: str, what: str) -> ConfigError:
        """The error when a lineage's markers are not where its partition count says."""
        n = self._marker_count()
        return ConfigError(
            f"{FORMAT}: {what}, but the markers of lineage {lineage} are not in partition "
            f"{marker_partition(self.marker_key(lineage), n)} of {n} of the marker topic "
            f"{self.marker_topic}: its partition count changed since the lineage started (markers "
            "are routed by it). Nothing was written. Set the count the lineage started with "
            "(KafkaSink(marker_partitions=M), option marker_partitions) so its markers and fence "
            "are found; only if this sink never wrote for this lineage, set it to the current count")

    # ---- validation ----------------------------------------------------------------------

    def validate(self, schema: StructType, overwrite: bool) -> None:
        md = reachable(self.conf, min(self.timeout, 15))
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
            warn_unverified(self.bootstrap, self.sink_id, self.mode, self.opts.get("checkpointlocation"))
        else:
            result = cached_probe(self.bootstrap, min(self.timeout, 20), self.conf)
            if not result.ok:
                raise ConfigError(
                    f"{FORMAT}: refusing mode exactly_once: {result.detail}. Use a broker whose "
                    "read_committed hides aborted transactions, or choose mode=\"at_least_once\" "
                    "explicitly (duplicates possible after failures); 'onceflow doctor --kafka "
                    f"{self.bootstrap}' shows the checks")
        limit = broker_config(self.conf, "transaction.max.timeout.ms", min(self.timeout, 15))
        if limit is not None and limit.isdigit() and self.conf["transaction.timeout.ms"] > int(limit):
            raise ConfigError(f"{FORMAT}: transaction_timeout={self.transaction_timeout:g}s exceeds the "
                              f"broker's transaction.max.timeout.ms={limit}; lower it or raise the broker's")
        ensure_marker_topic(self.conf, self.marker_topic, min(self.timeout, 15))

    # ---- tasks ---------------------------------------------------------------------------

    def is_decided(self, lineage: str, batch_id: int) -> bool:
        """Task, first step: fence this partition's older attempts, then read the markers.

        Fencing comes first: an older attempt that died between producing its marker and
        committing left a transaction open on the marker partition, and a read_committed read
        would wait for it until the transaction timeout. Only a short read for a newer epoch
        comes before it, so that a task of a fenced driver does not fence (and abort) the
        live driver's task of the same partition on its way out.
        """
        if self.mode != "exactly_once":
            return False
        task = TaskInfo.current()
        txn = self.txn_id(lineage, task.partition)
        if self.epoch is not None:
            markers = self._markers(lineage)
            try:
                markers.refresh(wait=0.5)
            except MarkerWait:
                pass  # what was read so far is checked; the full read follows the fencing
            self._check_task_epoch(markers, lineage, task.batch_id, task.partition)
        P.transactional_producer(self.conf, txn, self.timeout, fresh=True)  # init_transactions fences
        P._FENCED[txn] = (task.batch_id, task.attempt)
        markers = self._refreshed(lineage, {txn})
        self._check_task_epoch(markers, lineage, task.batch_id, task.partition)
        return markers.is_settled(batch_id)

    def _check_task_epoch(self, markers: MarkerLog, lineage: str, batch: int, partition: int) -> None:
        """A task of an older driver epoch than the lineage's latest stops before producing."""
        mine, current = self.epoch, markers.latest_epoch(self.sink_id, lineage)
        if mine is not None and current is not None and current > mine:
            raise fenced(FORMAT, lineage, mine, current, f"task of batch {batch} partition {partition}")
        if mine and (current is None or current < mine):  # its driver's epoch marker is elsewhere
            raise self._markers_moved(lineage, f"a task of batch {batch} holds epoch {mine}")

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
                stale = markers.uncommitted_txn_ids(self.sink_id, lineage) - own - {self.driver_txn_id(lineage)}
            except KafkaException as e:
                log.warning("%s: cannot list the transactions open on marker topic %s (%s); waiting "
                            "for them instead", FORMAT, self.marker_topic, error_text(e, self.conf))
                stale = set()
            for txn in sorted(stale):
                log.warning("%s: fencing transaction %s, open on the marker topic for too long", FORMAT, txn)
                try:
                    P.transactional_producer(self.conf, txn, self.timeout, fresh=True)
                except SinkError as e:
                    log.warning("%s: %s; waiting for the transaction instead", FORMAT, e)
                P.drop_producer(txn)
            return markers.refresh(wait=self.timeout)

    def _committed_parts(self, markers: MarkerLog, lineage: str, batch_id: int) -> dict[int, int | None]:
        """Partition -> rows of every partition marker of (lineage, batch): each one's rows are visible."""
        return {p: m.get("rows") for (s, lin, b, p), m in markers.parts.items()
                if s == self.sink_id and lin == lineage and b == batch_id}

    def visible_partitions(self, lineage: str, batch_id: int) -> dict[int, int | None]:
        """The partitions of batch N whose Kafka transactions committed (their markers), with
        their row counts. A read of the marker log; with ``fence_stale`` False it fences nothing."""
        if self.mode != "exactly_once":
            return {}
        return self._committed_parts(self._refreshed(lineage, set()), lineage, batch_id)

    def pre_commit(self, task: TaskInfo, schema: StructType, overwrite: bool, batches: Iterator):
        if self.mode != "exactly_once":
            return self._write_at_least_once(task, schema, batches)
        txn = self.txn_id(task.lineage, task.partition)
        # A producer initialised by this very task attempt (in is_decided), never an older
        # cached one: init_transactions fenced every older attempt of this partition.
        fresh = P._FENCED.pop(txn, None) != (task.batch_id, task.attempt)
        producer = P.transactional_producer(self.conf, txn, self.timeout, fresh=fresh)
        try:
            return self._pre_commit_txn(task, schema, producer, txn, batches)
        finally:
            P.drop_producer(txn)

    def _pre_commit_txn(self, task: TaskInfo, schema: StructType, producer, txn: str, batches: Iterator):
        fingerprint = task_fingerprint(self.opts.get("checkpointlocation"), task.batch_id)
        markers = self._refreshed(task.lineage, {txn})
        self._check_task_epoch(markers, task.lineage, task.batch_id, task.partition)
        done = markers.parts.get((self.sink_id, task.lineage, task.batch_id, task.partition))
        digest = ContentDigest()
        if done is not None:
            # Drained (upstream state commits only when the input is consumed) and digested:
            # skipped only when this replay read what the committed attempt read.
            for _ in digest.feed(batches):
                pass
            check_replay(f"{FORMAT} sink {self.sink_id}", task.batch_id, task.partition, task.lineage,
                         stored_fingerprint=done.get("fingerprint"), fingerprint=fingerprint,
                         stored_digest=done.get("digest"), digest=digest.hexdigest(),
                         committed=self._committed_parts(markers, task.lineage, task.batch_id))
            log.info("%s: batch %d partition %d already committed by attempt %s; skipped",
                     FORMAT, task.batch_id, task.partition, done.get("attempt"))
            return {"partition": task.partition, "attempt": done.get("attempt"),
                    "rows": done.get("rows"), "reused": True}, 0
        with P.Spool(digest.feed(batches)) as spool:  # Spark computes the partition here, no transaction open
            # Checked again: a newer driver may have opened while the partition was computed.
            self._check_task_epoch(self._refreshed(task.lineage, {txn}), task.lineage, task.batch_id,
                                   task.partition)
            return self._produce_txn(task, schema, producer, txn, spool, fingerprint, digest.hexdigest())

    def _produce_txn(self, task: TaskInfo, schema: StructType, producer, txn: str, spool: P.Spool,
                     fingerprint: str, digest: str):
        """One Kafka transaction: the spooled rows, then the partition marker."""
        from confluent_kafka import KafkaException

        started = time.monotonic()
        try:
            producer.begin_transaction()
            rows, errors = P.produce_rows(
                producer, schema, spool.batches(), value_column=self.value_column, key_column=self.key_column,
                topic_column=self.topic_column, topic=self.topic, bootstrap=self.bootstrap, timeout=self.timeout)
            producer.flush(self.timeout)
            if errors:
                raise SinkError(f"{FORMAT}: batch {task.batch_id} partition {task.partition}: "
                                f"{len(errors)} record(s) not delivered, first: {errors[0]}")
            marker = {"type": "partition", "sink": self.sink_id, "lineage": task.lineage,
                      "batch": task.batch_id, "partition": task.partition, "attempt": task.attempt,
                      "rows": rows, "fingerprint": fingerprint, "digest": digest, "txn": txn,
                      "epoch": self.epoch}
            self._produce_marker(producer, task.lineage,
                                 partition_key(self.sink_id, task.lineage, task.batch_id, task.partition), marker)
            P.commit(self.conf, producer, self.timeout)
        except (KafkaException, SinkError) as e:
            P.abort_quietly(self.conf, producer, txn, self.timeout)
            if isinstance(e, SinkError):
                raise
            elapsed = time.monotonic() - started
            hint = ""
            if is_fenced(e) or elapsed >= 0.9 * self.transaction_timeout:
                hint = (f"; the transaction was open {elapsed:.0f}s sending {spool.rows} rows: it was "
                        "fenced by a newer attempt of this partition, or aborted by the broker because "
                        f"it stayed open longer than transaction_timeout={self.transaction_timeout:g}s "
                        "(raise that option if sending one partition takes longer)")
            raise SinkError(f"{FORMAT}: transaction {txn} (batch {task.batch_id}) failed: "
                            f"{error_text(e, self.conf)}{hint}") from None
        except BaseException:
            P.abort_quietly(self.conf, producer, txn, self.timeout)
            raise
        handle = {"partition": task.partition, "attempt": task.attempt, "rows": rows, "reused": False}
        return handle, rows

    def _write_at_least_once(self, task: TaskInfo, schema: StructType, batches: Iterator):
        producer = P.at_least_once_producer(self.conf, f"alo-{self.bootstrap}-{json.dumps(self.conf, sort_keys=True, default=str)}")
        rows, errors = P.produce_rows(
            producer, schema, batches, value_column=self.value_column, key_column=self.key_column,
            topic_column=self.topic_column, topic=self.topic, bootstrap=self.bootstrap, timeout=self.timeout)
        left = producer.flush(self.timeout)
        if errors or left:
            raise SinkError(f"{FORMAT}: batch {task.batch_id} partition {task.partition}: "
                            f"{len(errors) + left} record(s) not delivered"
                            + (f", first: {errors[0]}" if errors else " (flush timed out)"))
        return {"partition": task.partition, "attempt": task.attempt, "rows": rows}, rows

    # ---- driver --------------------------------------------------------------------------

    def acquire_epoch(self, lineage: str) -> int:
        """Fence every older driver of the lineage, then commit an epoch marker one higher than
        the latest. at_least_once keeps no markers and fences nothing: epoch 0."""
        if self.mode != "exactly_once":
            return 0
        lineage = self.opts.get("lineage") or lineage  # the lineage the writer will write under
        ensure_marker_topic(self.conf, self.marker_topic, min(self.timeout, 15))
        txn = self.driver_txn_id(lineage)
        try:
            for attempt in fence_retries():
                with attempt:
                    return self._take_epoch(lineage, txn)
        except Refenced:
            raise SinkError(f"{FORMAT}: could not take a fencing epoch for lineage {lineage}: the "
                            f"driver id {txn} was initialised by another process {FENCE_RETRIES} "
                            "times in a row (another driver of this lineage is opening the sink "
                            "right now)") from None
        raise AssertionError("unreachable")

    def _committed_before(self, lineage: str) -> bool:
        """Whether the checkpoint committed batches of ``lineage`` (so it must have markers)."""
        loc = self.opts.get("checkpointlocation")
        if not loc or self._marker_count() == 1:  # one partition: markers cannot have moved
            return False
        ckpt = CheckpointDir(loc)
        try:
            return ckpt.exists() and ckpt.read_lineage() == lineage and ckpt.last_committed() is not None
        except (OSError, OnceflowError):
            return False

    def _take_epoch(self, lineage: str, txn: str) -> int:
        from confluent_kafka import KafkaException

        producer = P._init(self.conf, txn, self.timeout)  # fences older drivers, aborts their txn
        try:
            markers = self._refreshed(lineage, set())
            latest = markers.latest_epoch(self.sink_id, lineage)
            if latest is None and self._committed_before(lineage):
                raise self._markers_moved(lineage, "the checkpoint has committed batches of this lineage")
            epoch = (latest or 0) + 1
            producer.begin_transaction()
            self._produce_marker(producer, lineage, epoch_key(self.sink_id, lineage, epoch), {
                "type": "epoch", "sink": self.sink_id, "lineage": lineage, "epoch": epoch,
                "txn": txn, "at": round(time.time(), 3), "partitions": self._marker_count()})
            P.commit(self.conf, producer, self.timeout)
        except KafkaException as e:
            P.abort_quietly(self.conf, producer, txn, self.timeout)
            if is_fenced(e):
                log.warning("%s: another driver of lineage %s initialised %s while this one was "
                            "taking an epoch; trying again", FORMAT, lineage, txn)
                raise Refenced() from None
            raise SinkError(f"{FORMAT}: taking a fencing epoch for lineage {lineage} failed: "
                            f"{error_text(e, self.conf)}") from None
        P.keep_driver(txn, epoch, producer)
        log.info("%s: sink %s lineage %s: this driver holds epoch %d", FORMAT, self.sink_id, lineage, epoch)
        return epoch

    def _as_decision(self, lineage: str, batch_id: int, d: Mapping[str, Any]) -> Decision:
        return Decision(lineage, batch_id, d.get("fingerprint", "unknown"), d.get("handles", []), d.get("epoch"))

    def decision(self, lineage: str, batch_id: int) -> Decision | None:
        if self.mode != "exactly_once":
            return None
        d = self._refreshed(lineage, set()).decisions.get((self.sink_id, lineage, batch_id))
        return None if d is None else self._as_decision(lineage, batch_id, d)

    def _decidable(self, decision: Decision, mine: int | None) -> bool:
        """Read the markers: False when ``decision`` may be written, True when exactly it is
        already recorded; FencedError when a newer epoch opened or a rival decision exists."""
        lineage, batch = decision.lineage, decision.batch_id
        markers = self._refreshed(lineage, set())
        current = markers.latest_epoch(self.sink_id, lineage)
        what = f"the decision for batch {batch}"
        if current is not None and (mine is None or current > mine):
            raise fenced(FORMAT, lineage, mine, current, what)
        if mine is not None and (current is None or mine > current):
            raise ConfigError(f"{FORMAT}: epoch {mine} was never taken for lineage {lineage} (latest: "
                              f"{current}); the epoch option must come from the sink's open()")
        d = markers.decisions.get((self.sink_id, lineage, batch))
        if d is None:
            return False
        existing = self._as_decision(lineage, batch, d)
        if existing.same_as(decision):
            return True
        raise FencedError(
            f"{FORMAT}: {what} of lineage {lineage} refused: the batch is already decided "
            f"differently (fingerprint {existing.fingerprint}, epoch {existing.epoch}, "
            f"{len(existing.handles or [])} partition(s)) than this one (fingerprint "
            f"{decision.fingerprint}, epoch {decision.epoch}, {len(decision.handles or [])} "
            "partition(s)); nothing was written. Another driver of this lineage decided it: this "
            "driver stops")

    def decide(self, decision: Decision, schema: StructType, overwrite: bool) -> None:
        if self.mode != "exactly_once":
            return
        lineage, batch = decision.lineage, decision.batch_id
        mine = decision.epoch if decision.epoch is not None else self.epoch
        txn = self.driver_txn_id(lineage)
        if self._decidable(decision, mine):  # before a zombie's init could fence the live driver
            return
        marker = {"type": "decision", "sink": self.sink_id, "lineage": lineage, "batch": batch,
                  "fingerprint": decision.fingerprint, "handles": decision.handles, "epoch": mine,
                  "txn": txn}
        try:
            for attempt in fence_retries():
                with attempt:
                    fresh = attempt.retry_state.attempt_number > 1
                    return self._record_decision(decision, mine, txn, marker, fresh)
        except Refenced:
            raise FencedError(f"{FORMAT}: the decision for batch {batch} of lineage {lineage} was "
                              f"refused: the driver producer {txn} was fenced {FENCE_RETRIES} times "
                              "by another producer with the same id; nothing was written. Is a "
                              "second driver of this lineage running?") from None

    def _record_decision(self, decision: Decision, mine: int, txn: str, marker: dict, fresh: bool) -> None:
        from confluent_kafka import KafkaException

        lineage, batch = decision.lineage, decision.batch_id
        producer, initialised = P.driver_producer(self.conf, txn, mine, self.timeout, fresh=fresh)
        try:
            # The read that counts happens after this producer's init_transactions: any
            # newer epoch committed later fences this producer, so its commit below fails.
            if initialised and self._decidable(decision, mine):
                return
            producer.begin_transaction()
            self._produce_marker(producer, lineage, decision_key(self.sink_id, lineage, batch, mine), marker)
            P.commit(self.conf, producer, self.timeout)
        except KafkaException as e:
            P.abort_quietly(self.conf, producer, txn, self.timeout)
            P.drop_driver(txn, mine)
            if not is_fenced(e):
                raise SinkError(f"{FORMAT}: recording the decision for batch {batch} failed "
                                f"({error_text(e, self.conf)}); the batch is replayed after the "
                                "restart and its committed partitions are skipped") from None
            if self._decidable(decision, mine):  # FencedError when a newer epoch opened
                return
            log.warning("%s: driver producer %s was fenced but no newer epoch than %s exists "
                        "(another process of this driver initialised it); trying again",
                        FORMAT, txn, mine)
            raise Refenced() from None

    def commit(self, decision: Decision) -> None:
        """Nothing to make visible (each partition was, when its task's transaction committed);
        records where readers of the lineage may start from now on (start.py)."""
        maybe_crash("mid_commit", decision.batch_id, None, self.opts)
        loc = self.opts.get("checkpointlocation")
        if self.mode != "exactly_once" or not loc:
            return
        advance_start(self._markers(decision.lineage), loc, decision.batch_id, self.start_step)

    def abort(self, lineage: str, batch_id: int, handles: list[Any]) -> None:
        committed = sorted(h["partition"] for h in handles if h and not h.get("reused"))
        if committed and self.mode == "exactly_once":
            log.warning(
                "%s: batch %d of %s failed after partitions %s committed their Kafka transactions; "
                "they stay visible (Kafka cannot un-commit) and are skipped when the batch is replayed",
                FORMAT, batch_id, lineage, committed)

    def recover(self, lineage: str, in_flight: Sequence[Any] = ()) -> dict[str, int]:
        """Abort transactions left open by crashed tasks (they would hold the marker partition's
        last stable offset until they time out). Older drivers were fenced by acquire_epoch."""
        if self.mode != "exactly_once":
            return {}
        from confluent_kafka import KafkaException

        lineage = self.opts.get("lineage") or lineage  # as in acquire_epoch
        try:
            markers = self._markers(lineage)
            zombies = markers.uncommitted_txn_ids(self.sink_id, lineage)
        except KafkaException as e:
            log.warning("%s: could not look for open transactions of %s: %s", FORMAT, lineage,
                        error_text(e, self.conf))
            return {}
        live = {self.txn_id(lineage, h["partition"]) for h in in_flight if h}
        count = 0
        for txn in sorted(zombies - live - {self.driver_txn_id(lineage)}):
            P.transactional_producer(self.conf, txn, self.timeout, fresh=True)
            P.drop_producer(txn)
            count += 1
        ignored = sum(len(v) for (s, lin, _), v in markers.ignored.items() if s == self.sink_id and lin == lineage)
        if ignored:
            log.warning("%s: lineage %s: %d decision marker(s) written by fenced drivers after a newer "
                        "epoch opened are ignored", FORMAT, lineage, ignored)
        return {"open_transactions_aborted": count}
