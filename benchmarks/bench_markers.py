"""A new worker's first marker read on an aged marker topic, against an empty one (issue 28.11).

One command: ``python benchmarks/bench_markers.py [--others 1000000] [--settled 100000]``.
Starts its own tansu broker. Two marker topics, one partition each:

* **empty**: only the lineage's last ``--batches`` batches, decided by the sink's own driver;
* **aged**: first ``--others`` markers of other lineages and ``--settled`` decision and
  partition markers of this lineage's older batches, then the same ``--batches`` batches.

In both, the driver recorded the lineage's marker start in its checkpoint (start.py). Then,
``--repeat`` times each, a fresh process (as a new Python worker or a restarted driver is)
asks whether the next batch is decided, the first read of a task. It prints that process's
time for the read, the records it read and its peak RSS, and the ratio aged / empty.
``--no-start`` also measures the aged topic with the recorded start removed: the reader
then reads the whole partition (what every new process did before).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from confluent_kafka import Producer  # noqa: E402

from kafka_broker import KafkaBroker, create_topic  # noqa: E402
from onceflow.sinks.base import Decision  # noqa: E402
from onceflow.sinks.kafka import KafkaSink, close_all  # noqa: E402

SINK = "kafka"
HANDLES = [{"partition": p, "attempt": 0, "rows": 100, "reused": False} for p in range(2)]

READER = """
import json, sys, time
from onceflow.sinks.kafka import KafkaSink
bootstrap, topic, ckpt, lineage, batch = sys.argv[1:6]
t0 = time.perf_counter()
ds = KafkaSink(bootstrap, "unused", marker_topic=topic, timeout=300).data_source({"checkpointlocation": ckpt})
decided = ds.decision(lineage, int(batch)) is not None
took = time.perf_counter() - t0
log = ds._markers(lineage)
# VmHWM: this process's own peak (ru_maxrss would carry the parent's peak across fork + exec)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"s": took, "decided": decided, "read": log.records_read, "rss_mb": hwm / 1024}))
"""


def fill(bootstrap: str, topic: str, others: int, settled: int, lineage: str) -> None:
    """Markers of other lineages and of this lineage's settled batches, interleaved, batched."""
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.num.messages": 10000,
                  "queue.buffering.max.messages": 1000000})
    every = max(1, others // max(1, settled))
    batch, t0 = 0, time.monotonic()
    for i in range(others):
        other = f"other-{i % 1000}"
        m = {"type": "decision", "sink": SINK, "lineage": other, "batch": i // 1000, "fingerprint": "0" * 32,
             "handles": HANDLES, "epoch": 1}
        p.produce(topic, json.dumps(m).encode(), f"{SINK}/{other}/d/{i // 1000}/1".encode(), partition=0)
        if i % every == 0 and batch < settled:
            kind = "decision" if batch % 3 == 2 else "partition"
            m = {"type": kind, "sink": SINK, "lineage": lineage, "batch": batch, "partition": batch % 2,
                 "fingerprint": "0" * 32, "handles": HANDLES, "epoch": 1, "rows": 100}
            p.produce(topic, json.dumps(m).encode(), f"{SINK}/{lineage}/x/{batch}".encode(), partition=0)
            batch += 1
        if i % 100000 == 0:
            p.poll(0)
            if i:
                print(f"  {topic}: {i:,} markers ({i / (time.monotonic() - t0):,.0f}/s)", flush=True)
    assert p.flush(600) == 0


def drive(bootstrap: str, topic: str, ckpt: str, lineage: str, first: int, batches: int) -> int:
    """The sink's driver decides ``batches`` batches after ``first`` and records its start."""
    ds = KafkaSink(bootstrap, "unused", marker_topic=topic, timeout=300, marker_start_step=0,
                   producer_config={"batch.num.messages": 1, "linger.ms": 0}).data_source({"checkpointlocation": ckpt})
    epoch = ds.open(lineage)
    for b in range(first, first + batches):
        d = Decision(lineage, b, f"{b:032d}", HANDLES, epoch)
        ds.decide(d, None, False)
        ds.commit(d)
    close_all()
    return first + batches


def reads(bootstrap: str, topic: str, ckpt: str, lineage: str, batch: int, repeat: int) -> list[dict]:
    out = []
    for _ in range(repeat):
        r = subprocess.run([sys.executable, "-c", READER, bootstrap, topic, ckpt, lineage, str(batch)],
                           capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            raise SystemExit(f"reader failed: {r.stderr[-2000:]}")
        out.append(json.loads(r.stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--others", type=int, default=1_000_000, help="markers of other lineages")
    ap.add_argument("--settled", type=int, default=100_000, help="markers of this lineage's settled batches")
    ap.add_argument("--batches", type=int, default=20, help="recent batches decided by the driver")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-start", action="store_true", help="also read the aged topic without a recorded start")
    a = ap.parse_args()
    with KafkaBroker() as broker, tempfile.TemporaryDirectory() as tmp:
        bs, rows = broker.bootstrap, {}
        for name, others, settled in (("empty", 0, 0), ("aged", a.others, a.settled)):
            topic, lineage = f"markers-{name}-{uuid.uuid4().hex[:6]}", str(uuid.uuid4())
            ckpt = os.path.join(tmp, name)
            os.makedirs(ckpt)
            create_topic(bs, topic, 1)
            t0 = time.monotonic()
            fill(bs, topic, others, settled, lineage)
            nxt = drive(bs, topic, ckpt, lineage, settled, a.batches)
            print(f"{name}: {others:,} other markers, {settled:,} settled, {a.batches} batches decided "
                  f"({time.monotonic() - t0:.0f}s to prepare)", flush=True)
            rows[name] = reads(bs, topic, ckpt, lineage, nxt, a.repeat)
            if name == "aged" and a.no_start:
                os.remove(os.path.join(ckpt, "_onceflow", "sink-cache", f"kafka-markers-{SINK}.json"))
                rows["aged, no start recorded"] = reads(bs, topic, ckpt, lineage, nxt, 1)
    print(f"\n{'topic':<26}{'first read s (median)':>22}{'records read':>14}{'peak RSS MB':>13}")
    for name, rs in rows.items():
        print(f"{name:<26}{statistics.median(r['s'] for r in rs):>22.3f}{rs[0]['read']:>14,}"
              f"{max(r['rss_mb'] for r in rs):>13.0f}")
    e, g = rows["empty"], rows["aged"]
    print(f"\naged / empty: time {statistics.median(r['s'] for r in g) / statistics.median(r['s'] for r in e):.2f}x, "
          f"peak RSS {max(r['rss_mb'] for r in g) / max(r['rss_mb'] for r in e):.2f}x (target: within 2x)")


if __name__ == "__main__":
    main()
