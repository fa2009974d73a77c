"""The Kafka sink's producers, cached per Python process, and the row-producing loop.

Guarantees:
- :func:`transactional_producer` returns a producer on which ``init_transactions()`` has
  completed: every older producer with the same ``transactional.id`` (an older task attempt,
  an older driver) is fenced by it, and its open transaction is aborted. ``fresh=True`` always
  creates a new one, which is how a task attempt fences the attempts before it.
- Driver producers are cached per (transactional id, epoch): a driver incarnation keeps using
  the producer it initialised, so a newer incarnation's ``init_transactions`` fences it at the
  broker (its next transaction fails with PRODUCER_FENCED), whatever process it runs in.
- A producer failure becomes :class:`~onceflow.errors.SinkError` (an outage, retried), except a
  ``transaction.timeout.ms`` the broker refuses, which is a
  :class:`~onceflow.errors.ConfigError` naming the ``transaction_timeout`` option. Fencing is
  reported by :func:`~onceflow.kafka_client.is_fenced`; callers turn it into FencedError.
- :class:`Spool` drains a task's input to a local Arrow IPC file before any transaction
  begins, so the time Spark needs to compute the partition (upstream stages, a slow source)
  never counts against the transaction timeout: a transaction spans only sending rows that
  already exist. The file is removed when the task is done, whatever happens.
- :func:`produce_rows` produces every row of the Arrow batches and reports every delivery
  error; it never drops a row silently.
- Transaction ends (``init_transactions``, :func:`commit`, :func:`abort_quietly`) run inside
  the end guard registered for their broker (:func:`guard_ends`), if any: the tansu
  workaround (:mod:`~onceflow.sinks.kafka.turns`) is one, installed only when the sink
  serializes commits. Against a real broker no guard is registered and ends run as they are.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from pyspark.sql.types import StructType

from onceflow.errors import ConfigError, SinkError
from onceflow.kafka_client import error_text
from onceflow.sinks.kafka.common import FORMAT

_PRODUCERS: dict[str, Any] = {}
#: (transactional id, epoch) -> producer of this process's driver incarnations
_DRIVERS: dict[tuple[str, int | None], Any] = {}
#: txn id -> (batch, attempt) of the task attempt whose is_decided initialised its producer
_FENCED: dict[str, tuple[int, int]] = {}
_KNOWN_TOPICS: dict[tuple[str, str], bool] = {}
#: bootstrap -> what each transaction end on that broker runs inside (see :func:`guard_ends`)
_END_GUARDS: dict[str, Callable[[], AbstractContextManager[Any]]] = {}


def guard_ends(bootstrap: str, guard: Callable[[], AbstractContextManager[Any]]) -> None:
    """From now on, this process's transaction ends on ``bootstrap`` run inside ``guard()``."""
    _END_GUARDS[bootstrap] = guard


def ending(conf: Mapping[str, Any]) -> AbstractContextManager[Any]:
    """The guard of a transaction end on ``conf``'s broker (none for most brokers)."""
    guard = _END_GUARDS.get(conf["bootstrap.servers"])
    return guard() if guard is not None else nullcontext()


def _init(conf: Mapping[str, Any], txn_id: str, timeout: float):
    from confluent_kafka import KafkaError, KafkaException, Producer

    try:
        producer = Producer({**conf, "transactional.id": txn_id})
    except (KafkaException, ValueError, TypeError) as e:
        raise ConfigError(f"{FORMAT}: invalid producer_config: {error_text(e, conf)}; see "
                          "librdkafka's CONFIGURATION.md") from None
    try:
        with ending(conf):  # aborts an older attempt's open transaction
            producer.init_transactions(timeout)
    except KafkaException as e:
        if e.args[0].code() == KafkaError.INVALID_TRANSACTION_TIMEOUT:
            raise ConfigError(
                f"{FORMAT}: the broker refused transaction.timeout.ms="
                f"{conf.get('transaction.timeout.ms')} ({error_text(e, conf)}); set the sink's "
                "transaction_timeout (seconds) to at most the broker's transaction.max.timeout.ms"
            ) from None
        raise SinkError(f"{FORMAT}: init_transactions for {txn_id} on {conf['bootstrap.servers']} "
                        f"failed: {error_text(e, conf)}") from None
    return producer


def transactional_producer(conf: Mapping[str, Any], txn_id: str, timeout: float, fresh: bool = False):
    """An initialised transactional producer for ``txn_id`` (cached unless ``fresh``)."""
    producer = None if fresh else _PRODUCERS.get(txn_id)
    if producer is None:
        producer = _PRODUCERS[txn_id] = _init(conf, txn_id, timeout)
    return producer


def drop_producer(txn_id: str) -> None:
    _PRODUCERS.pop(txn_id, None)


def driver_producer(conf: Mapping[str, Any], txn_id: str, epoch: int | None, timeout: float,
                    fresh: bool = False) -> tuple[Any, bool]:
    """The driver producer of this incarnation (``epoch``); returns (producer, initialised
    now). A new one fences every other producer of ``txn_id``, older or newer."""
    producer = None if fresh else _DRIVERS.get((txn_id, epoch))
    if producer is not None:
        return producer, False
    producer = _init(conf, txn_id, timeout)
    keep_driver(txn_id, epoch, producer)
    return producer, True


def keep_driver(txn_id: str, epoch: int | None, producer) -> None:
    """Cache ``producer`` as the driver producer of ``epoch``. Older epochs' producers stay
    (the newest 4 per id): an older incarnation in this process must keep its own, fenced one
    rather than initialise a new one, which would fence the newer incarnation's."""
    _DRIVERS[(txn_id, epoch)] = producer
    mine = sorted((k for k in _DRIVERS if k[0] == txn_id), key=lambda k: k[1] or 0)
    for key in mine[:-4]:
        del _DRIVERS[key]


def drop_driver(txn_id: str, epoch: int | None) -> None:
    _DRIVERS.pop((txn_id, epoch), None)


def commit(conf: Mapping[str, Any], producer, timeout: float) -> None:
    """Commit ``producer``'s transaction (inside its broker's end guard, if any)."""
    with ending(conf):
        producer.commit_transaction(timeout)


def abort_quietly(conf: Mapping[str, Any], producer, txn: str, timeout: float) -> None:
    try:
        with ending(conf):
            producer.abort_transaction(timeout)
    except Exception:  # noqa: BLE001 - fenced or broken: a fresh producer re-initialises
        drop_producer(txn)


def at_least_once_producer(conf: Mapping[str, Any], key: str):
    from confluent_kafka import Producer

    producer = _PRODUCERS.get(key)
    if producer is None:
        producer = _PRODUCERS[key] = Producer(conf)
    return producer


class Spool:
    """A task's Arrow batches drained to a temporary local file (Arrow IPC stream) and read
    back memory-mapped. Use as a context manager; ``rows`` counts the rows spooled."""

    def __init__(self, batches: Iterator):
        import pyarrow as pa

        local = [d for d in os.environ.get("SPARK_LOCAL_DIRS", "").split(",") if d and os.path.isdir(d)]
        fd, self.path = tempfile.mkstemp(prefix="onceflow-kafka-", suffix=".arrows",
                                         dir=local[0] if local else None)
        os.close(fd)
        self.rows = 0
        writer = None
        try:
            for batch in batches:
                if not batch.num_rows:
                    continue
                if writer is None:
                    writer = pa.ipc.new_stream(self.path, batch.schema)
                writer.write_batch(batch)
                self.rows += batch.num_rows
        except BaseException:
            self.close()
            raise
        finally:
            if writer is not None:
                writer.close()

    def batches(self) -> Iterator:
        import pyarrow as pa

        if not self.rows:
            return iter(())
        return iter(pa.ipc.open_stream(pa.memory_map(self.path)))

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def produce_rows(producer, schema: StructType, batches: Iterator, *, value_column: str, key_column: str,
                 topic_column: str, topic: str | None, bootstrap: str, timeout: float) -> tuple[int, list[str]]:
    """Produce the rows of ``batches``; return (rows produced, delivery errors so far)."""
    names = [f.name for f in schema.fields]
    errors: list[str] = []

    def on_delivery(err, msg) -> None:
        if err is not None:
            errors.append(f"topic {msg.topic()}: {err.str()}")

    rows = 0
    has_key, has_topic = key_column in names, topic_column in names and topic is None
    has_part, has_headers = "partition" in names, "headers" in names
    for batch in batches:
        if not batch.num_rows:
            continue
        values = batch.column(names.index(value_column)).to_pylist()
        keys = batch.column(names.index(key_column)).to_pylist() if has_key else None
        topics = batch.column(names.index(topic_column)).to_pylist() if has_topic else None
        parts = batch.column(names.index("partition")).to_pylist() if has_part else None
        headers = batch.column(names.index("headers")).to_pylist() if has_headers else None
        for i, value in enumerate(values):
            target = topics[i] if topics is not None else topic
            if topics is not None:
                check_topic(producer, target, topic_column, bootstrap, timeout)
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
                    producer.produce(target, **kwargs)
                    break
                except BufferError:
                    producer.poll(0.05)
            rows += 1
        producer.poll(0)
    return rows, errors


def check_topic(producer, topic: str | None, topic_column: str, bootstrap: str, timeout: float) -> None:
    """Per-row topics: fail fast naming an unknown topic (instead of a delivery timeout)."""
    if topic is None:
        raise SinkError(f"{FORMAT}: a row has a null {topic_column!r} and no topic option is set")
    key = (bootstrap, topic)
    if key not in _KNOWN_TOPICS:
        md = producer.list_topics(topic, timeout=min(timeout, 15)).topics.get(topic)
        if md is None or md.error is not None:
            raise SinkError(f"{FORMAT}: topic {topic} (from column {topic_column!r}) does not "
                            f"exist on {bootstrap}; create it or fix the column")
        _KNOWN_TOPICS[key] = True


def close_producers() -> None:
    """Forget this process's cached producers."""
    _PRODUCERS.clear()
    _DRIVERS.clear()
    _FENCED.clear()
    _KNOWN_TOPICS.clear()
