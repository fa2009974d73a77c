"""What a verify run prepares before its job starts, and removes after.

* the work directory and the spec file the job reads;
* with ``--checkpoint-fs SIZE``: a tmpfs of that size for the checkpoint (root only), so the
  ``disk_full`` fault fills a small filesystem and never the machine's disk;
* with a Kafka source: the input topic, holding every event ``id,payload,checksum``;
* with a Kafka sink: the output topic.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console

from onceflow.errors import ConfigError
from onceflow.verify.spec import Options, VerifySpec, checksum, payload


@contextmanager
def environment(spec: VerifySpec, options: Options, console: Console) -> Iterator[None]:
    os.makedirs(spec.workdir, exist_ok=True)
    mount = None
    if options.checkpoint_fs:
        if os.geteuid() != 0:
            raise ConfigError("verify: --checkpoint-fs mounts a tmpfs and needs root; run as root, or "
                              "leave out the disk_full fault")
        mount = os.path.join(spec.workdir, "checkpoint-fs")
        os.makedirs(mount, exist_ok=True)
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={options.checkpoint_fs}", "tmpfs", mount],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise ConfigError(f"verify: could not mount a {options.checkpoint_fs} tmpfs on {mount}: "
                              f"{res.stderr.strip()}")
        spec.checkpoint_dir = os.path.join(mount, "checkpoint")
    try:
        spec.save()
        if spec.source == "kafka":
            _create_topic(spec.kafka, spec.input_topic, spec.partitions)
            _produce(spec, console)
        if spec.sink.startswith("kafka"):
            _create_topic(spec.kafka, spec.table, spec.partitions)
        yield
    finally:
        if mount:
            subprocess.run(["umount", "-l", mount], capture_output=True)


def _create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})  # must outlive the futures
    futures = admin.create_topics([NewTopic(topic, partitions, 1)], request_timeout=15)
    try:
        futures[topic].result(20)
    except Exception as e:  # noqa: BLE001 - one line that says what failed
        if "TOPIC_ALREADY_EXISTS" not in str(e):
            raise ConfigError(f"verify: could not create topic {topic} on {bootstrap}: {e}") from None


def _produce(spec: VerifySpec, console: Console) -> None:
    """Every event into the input topic, ids spread round-robin over its partitions."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": spec.kafka, "linger.ms": 20, "enable.idempotence": True})
    failed: list[str] = []

    def on_delivery(err, _msg) -> None:
        if err is not None:
            failed.append(str(err))

    with console.status(f"producing {spec.events:,} events into {spec.input_topic}"):
        for i in range(spec.events):
            p = payload(i)
            while True:
                try:
                    producer.produce(spec.input_topic, f"{i},{p},{checksum(p)}".encode(), key=str(i).encode(),
                                     partition=i % spec.partitions, on_delivery=on_delivery)
                    break
                except BufferError:
                    producer.poll(0.1)
        if producer.flush(60) or failed:
            raise ConfigError(f"verify: producing the input events failed: {failed[:1] or 'flush timed out'}")
        # One sentinel (id -1, dropped by the job) per partition, in a batch of its own: some
        # brokers (tansu) report the log end as the last *batch's* first offset + 1, which would
        # hide the tail of the last batch of events from every consumer that asks for the end.
        # tansu on object storage takes the batch with the newest last-modified time, of
        # one-second resolution: the first batch written in the last second. The pause makes
        # the sentinel the only batch of its second, so the end it reports is exact.
        time.sleep(1.1)
        for p in range(spec.partitions):
            producer.produce(spec.input_topic, b"-1,,", partition=p, on_delivery=on_delivery)
            producer.flush(30)
        if failed:
            raise ConfigError(f"verify: producing the input events failed: {failed[:1]}")
