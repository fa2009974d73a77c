"""Example job: events from an Amazon Kinesis data stream -> a Delta table.

    pip install 'onceflow[kinesis,delta]'
    export AWS_REGION=eu-west-1          # credentials: the usual AWS_* variables or profile
    onceflow run examples/kinesis_to_delta.py -- --stream events

Each record's data is JSON, ``{"device": "d1", "reading": 21.5}``. The source keeps the last
sequence number per shard in Spark's checkpoint only (no KCL lease table) and reads a
resharded stream's parents first; each micro-batch is one Delta commit, so a replay after a
crash adds nothing twice. Arguments: ``--table`` (default ``example-out/readings``),
``--checkpoint`` (default ``example-out/kinesis-to-delta``), ``--endpoint-url`` (a Kinesis
API elsewhere, e.g. a local one), ``--stop-when-idle SECONDS``.
"""

import argparse

from pyspark.sql import functions as F

from onceflow import CheckpointConfig, DeltaSink, Job, KinesisSource, exponential_delay

parser = argparse.ArgumentParser(prog="kinesis_to_delta.py")
parser.add_argument("--stream", required=True)
parser.add_argument("--region", default=None, help="default: AWS_REGION / the profile's")
parser.add_argument("--endpoint-url", default=None)
parser.add_argument("--table", default="example-out/readings")
parser.add_argument("--checkpoint", default="example-out/kinesis-to-delta")
parser.add_argument("--stop-when-idle", type=float, default=None)
args = parser.parse_args()

READING = "device string, reading double"


def readings(df):
    """Kinesis records -> (device, reading, shardId, sequenceNumber, arrived)."""
    reading = F.from_json(F.col("data").cast("string"), READING)
    return (df.select(reading.alias("r"), "shardId", "sequenceNumber",
                      F.col("approximateArrivalTimestamp").alias("arrived"))
            .select("r.*", "shardId", "sequenceNumber", "arrived"))


job = Job(
    name="kinesis-to-delta",
    source=KinesisSource(args.stream, starting_position="TRIM_HORIZON", region=args.region,
                         endpoint_url=args.endpoint_url).load,
    transform=readings,
    sink=DeltaSink(args.table),
    checkpoint=CheckpointConfig(args.checkpoint, interval="1 s"),
    restart_strategy=exponential_delay(initial_backoff="1 s", max_backoff="30 s"),
    stop_when_idle=args.stop_when_idle,
)
