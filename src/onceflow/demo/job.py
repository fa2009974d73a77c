"""The demo job: consecutive event ids -> running count per key -> Delta.

Configured by environment variables so the supervisor can restart it unchanged:
ONCEFLOW_DEMO_DIR (work directory), ONCEFLOW_DEMO_EVENTS, ONCEFLOW_DEMO_RATE.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from onceflow import CheckpointConfig, DeltaSink, Job, fixed_delay
from onceflow.settings import setting

OUTPUT = "id long, key long, event_time timestamp, running_count long"


def running_count(key, frames: Iterator, state) -> Iterator:
    """Each event with its key's running count; the count lives in Spark's state store."""
    import numpy as np
    import pandas as pd

    seen = state.get[0] if state.exists else 0
    batch = pd.concat(list(frames)).sort_values("id")  # deterministic order on replay
    batch["running_count"] = seen + np.arange(1, len(batch) + 1, dtype="int64")
    state.update((seen + len(batch),))
    yield batch[["id", "key", "event_time", "running_count"]]


def transform(df):
    from pyspark.sql.streaming.state import GroupStateTimeout

    return df.groupBy("key").applyInPandasWithState(
        running_count, OUTPUT, "count long", "append", GroupStateTimeout.NoTimeout
    )


def source(spark):
    rate = int(setting("ONCEFLOW_DEMO_RATE", "100000"))
    return (
        spark.readStream.format("onceflow-sequence")
        .option("total", int(setting("ONCEFLOW_DEMO_EVENTS", "3000000")))
        .option("rows_per_second", rate)
        .option("max_rows_per_batch", rate)  # at most one second's worth per batch
        .option("keys", 16)
        .load()
    )


_dir = setting("ONCEFLOW_DEMO_DIR", "onceflow-demo")
job = Job(
    name="demo",
    source=source,
    transform=transform,
    # arrow: its Python tasks log the records they process, replays included (the demo's report)
    sink=DeltaSink(os.path.join(_dir, "events"), writer="arrow"),
    checkpoint=CheckpointConfig(os.path.join(_dir, "checkpoint"), interval="1 s"),
    # no pause before a restart: the warm standby takes over at once (a job that fails on its own
    # would want a delay; these kills are the demo's)
    restart_strategy=fixed_delay(attempts=10, delay=0),
    stop_when_idle=3.0,
    master="local[2]",
    # one state partition per core (onceflow's default is 4): 16 keys need no more, and every
    # batch, the first after a takeover included, runs one Python task per core instead of two
    spark_conf={"spark.sql.shuffle.partitions": "2"},
)
