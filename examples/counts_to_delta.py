"""Example job: a stateful running count per key -> Delta, and an upgrade through a savepoint.

    onceflow run examples/counts_to_delta.py           # supervised; Ctrl-C stops with a savepoint
    kill -9 <driver pid>                                # watch it restart and catch up

Upgrade (version 2 adds a column; the stateful operator and its state carry over):

    onceflow run examples/counts_to_delta.py -- --total 3000 --stop-when-idle 3
    onceflow savepoint create example-out/checkpoint example-out/sp     # or: Ctrl-C / onceflow stop
    onceflow run --from-savepoint example-out/sp --checkpoint example-out/checkpoint-v2 \\
        examples/counts_to_delta.py -- --v2 --total 6000 --stop-when-idle 3

The source is onceflow's replayable id generator (``onceflow-sequence``: ``id``, ``key = id %
16``, ``event_time``); each event leaves with its key's running count, kept in Spark's state
store (RocksDB). Version 2 writes a new column ``bucket``; ``schema_mode="merge"`` adds it to
the table in the commit of its first batch. Writes ``--out`` (default ``example-out``):
``events`` (the table) and ``checkpoint``; ``checkpoint/_onceflow/events.jsonl`` logs every
batch, sink commit and restart.
"""

import argparse
import os
from collections.abc import Iterator

from onceflow import CheckpointConfig, DeltaSink, Job, exponential_delay

parser = argparse.ArgumentParser(prog="counts_to_delta.py")
parser.add_argument("--out", default="example-out")
parser.add_argument("--total", type=int, default=None, help="stop the source after N events")
parser.add_argument("--rate", type=int, default=20_000, help="events per second")
parser.add_argument("--v2", action="store_true", help="version 2 of the job: adds column bucket")
parser.add_argument("--stop-when-idle", type=float, default=None)
args = parser.parse_args()

OUTPUT = "id long, key long, event_time timestamp, running_count long"


def running_count(key, frames: Iterator, state) -> Iterator:
    """Each event of one key with the key's running count (the count lives in Spark's state)."""
    import numpy as np
    import pandas as pd

    seen = state.get[0] if state.exists else 0
    batch = pd.concat(list(frames)).sort_values("id")  # deterministic order on replay
    batch["running_count"] = seen + np.arange(1, len(batch) + 1, dtype="int64")
    state.update((seen + len(batch),))
    yield batch[["id", "key", "event_time", "running_count"]]


def source(spark):
    stream = (spark.readStream.format("onceflow-sequence")
              .option("rows_per_second", args.rate).option("max_rows_per_batch", args.rate))
    return stream.option("total", args.total).load() if args.total else stream.load()


def transform(df):
    from pyspark.sql.streaming.state import GroupStateTimeout

    counted = df.groupBy("key").applyInPandasWithState(
        running_count, OUTPUT, "count long", "append", GroupStateTimeout.NoTimeout)
    # version 2: a stateless change after the stateful operator (its id and state stay the same)
    return counted.withColumn("bucket", counted.key % 4) if args.v2 else counted


job = Job(
    name="counts-to-delta",
    source=source,
    transform=transform,
    sink=DeltaSink(os.path.join(args.out, "events"), schema_mode="merge"),
    checkpoint=CheckpointConfig(os.path.join(args.out, "checkpoint"), interval="1 s",
                                state_backend="rocksdb"),
    restart_strategy=exponential_delay(initial_backoff="1 s", max_backoff="30 s"),
    stop_when_idle=args.stop_when_idle,
)
