"""Example job: consecutive event ids -> running count per key -> Delta table.

    onceflow run examples/counts_to_delta.py          # supervised; Ctrl-C stops cleanly
    kill -9 <driver pid>                               # watch it restart and catch up

Writes ./example-out/{events,checkpoint}. The checkpoint's _onceflow/events.jsonl logs every
batch, sink commit and restart.
"""

from onceflow import CheckpointConfig, DeltaSink, Job, exponential_delay
from onceflow.demo.job import transform  # applyInPandasWithState running count per key

job = Job(
    name="counts-to-delta",
    source=lambda spark: spark.readStream.format("onceflow-sequence")
    .option("rows_per_second", 20_000).option("max_rows_per_batch", 20_000).load(),
    transform=transform,
    sink=DeltaSink("example-out/events"),
    checkpoint=CheckpointConfig("example-out/checkpoint", interval="1 s", state_backend="rocksdb"),
    restart_strategy=exponential_delay(initial_backoff="1 s", max_backoff="30 s"),
)
