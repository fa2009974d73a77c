"""Reproduce the tansu 0.6 wedge that onceflow's Kafka sink takes turns against.

One command: ``python benchmarks/tansu_wedge.py [--rounds R] [--batches B] [--tasks T]``.
Starts its own tansu broker (in-memory). Each round makes a fresh 2-partition data topic and
1-partition marker topic and runs B batches shaped like the sink's: T transactional
producers at once (a fresh ``init_transactions`` each, as a task attempt), each producing 100
records to the data topic and one marker, then committing; then a read_committed reader must
reach the marker partition's end before one "decision" transaction commits. A round is
wedged when the reader stays behind for 15 s. Rounds alternate between ends at once (turns
off) and ends taking turns through ``onceflow.sinks.kafka.turns`` (what the sink does with
``serialize_commits``); the table gives wedged rounds, batches done and tansu's
``otherwise=Some(Committed)`` warnings for each. See onceflow/sinks/kafka/turns.py for the
mechanism.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from confluent_kafka import Consumer, Producer, TopicPartition  # noqa: E402

from kafka_broker import KafkaBroker, create_topic  # noqa: E402
from onceflow.sinks.kafka import turns  # noqa: E402


def one_round(bootstrap: str, batches: int, tasks: int, serial: bool) -> int:
    """Batches done before the marker partition wedged (``batches``: it never did)."""
    data, markers = f"wedge-d-{uuid.uuid4().hex[:6]}", f"wedge-m-{uuid.uuid4().hex[:6]}"
    create_topic(bootstrap, data, 2)
    create_topic(bootstrap, markers, 1)
    conf = {"bootstrap.servers": bootstrap, "batch.num.messages": 1, "linger.ms": 0}
    (turns.serialize if serial else turns._SERIAL.discard)(bootstrap)
    group = uuid.uuid4().hex[:8]
    reader = Consumer({**conf, "group.id": f"r-{group}", "isolation.level": "read_committed",
                       "enable.auto.commit": False, "enable.partition.eof": False})
    ends = Consumer({**conf, "group.id": f"e-{group}", "isolation.level": "read_uncommitted",
                     "enable.auto.commit": False})
    tp = TopicPartition(markers, 0)
    reader.assign([TopicPartition(markers, 0, 0)])

    def reached_end(wait: float = 15.0) -> bool:
        _, end = ends.get_watermark_offsets(tp, timeout=10, cached=False)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            reader.consume(1000, 0.2)
            if (reader.position([tp])[0].offset or 0) >= end:
                return True
        return False

    def task(batch: int, partition: int) -> None:
        producer = Producer({**conf, "transactional.id": f"wedge-{group}-p{partition}"})
        with turns.ending(conf):
            producer.init_transactions(10)
        producer.begin_transaction()
        for i in range(100):
            producer.produce(data, str(i).encode(), str(i).encode())
        producer.produce(markers, json.dumps({"batch": batch, "partition": partition}).encode(), partition=0)
        producer.flush(10)
        with turns.ending(conf):
            producer.commit_transaction(10)

    driver = Producer({**conf, "transactional.id": f"wedge-{group}-driver"})
    driver.init_transactions(10)
    try:
        with ThreadPoolExecutor(tasks) as pool:
            for batch in range(batches):
                list(pool.map(task, [batch] * tasks, range(tasks)))
                if not reached_end():
                    return batch
                driver.begin_transaction()
                driver.produce(markers, json.dumps({"decision": batch}).encode(), partition=0)
                with turns.ending(conf):
                    driver.commit_transaction(10)
        return batches
    finally:
        reader.close()
        ends.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds per setting (default 3)")
    ap.add_argument("--batches", type=int, default=40, help="batches per round (default 40)")
    ap.add_argument("--tasks", type=int, default=4, help="producers ending at once (default 4)")
    args = ap.parse_args()
    os.environ.setdefault("RUST_LOG", "warn")
    results: dict[bool, list[int]] = {False: [], True: []}
    warnings: dict[bool, int] = {False: 0, True: 0}
    for serial in (False, True):
        for r in range(args.rounds):
            with KafkaBroker() as broker:  # a wedge is for good: a fresh broker per round
                started = time.monotonic()
                done = one_round(broker.bootstrap, args.batches, args.tasks, serial)
                warnings[serial] += broker.log_text(tail=None).count("otherwise=")
            results[serial].append(done)
            state = "wedged after" if done < args.batches else "all"
            print(f"turns {'on ' if serial else 'off'} round {r + 1}: {state} {done} batches "
                  f"({time.monotonic() - started:.1f}s)", flush=True)
    print(f"\n{'ends':<12}{'wedged rounds':>15}{'batches done':>15}{'otherwise= lines':>18}")
    for serial in (False, True):
        wedged = sum(d < args.batches for d in results[serial])
        print(f"{'take turns' if serial else 'at once':<12}{f'{wedged}/{args.rounds}':>15}"
              f"{sum(results[serial]):>15}{warnings[serial]:>18}")


if __name__ == "__main__":
    main()
