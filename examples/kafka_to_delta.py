"""Example job: page views from Kafka -> a Delta table partitioned by day.

    pip install 'onceflow[kafka,delta]'
    onceflow run examples/kafka_to_delta.py -- --bootstrap kafka:9092 --topic views

Each record's value is JSON, ``{"user": "u7", "page": "/cart", "ts": "2026-11-27T10:15:00Z"}``.
Rows land in ``--table`` (default ``example-out/views``) under ``day=YYYY-MM-DD/`` directories:
the table is created with ``partition_by=["day"]``, and each micro-batch is one Delta commit
carrying the batch's app transaction, so a crash and replay adds no file twice. Arguments:
``--checkpoint`` (default ``example-out/kafka-to-delta``), ``--stop-when-idle SECONDS``.
"""

import argparse

from pyspark.sql import functions as F

from onceflow import CheckpointConfig, DeltaSink, Job, KafkaSource, exponential_delay

parser = argparse.ArgumentParser(prog="kafka_to_delta.py")
parser.add_argument("--bootstrap", required=True, help="Kafka bootstrap servers")
parser.add_argument("--topic", default="views")
parser.add_argument("--table", default="example-out/views")
parser.add_argument("--checkpoint", default="example-out/kafka-to-delta")
parser.add_argument("--stop-when-idle", type=float, default=None)
args = parser.parse_args()

VIEW = "user string, page string, ts timestamp"


def views(df):
    """Kafka records -> (user, page, ts, day, partition, offset)."""
    view = F.from_json(F.col("value").cast("string"), VIEW, {"timestampFormat": "yyyy-MM-dd'T'HH:mm:ssX"})
    parsed = df.select(view.alias("v"), "partition", "offset").select("v.*", "partition", "offset")
    return parsed.where("ts IS NOT NULL").withColumn("day", F.to_date("ts").cast("string"))


job = Job(
    name="kafka-to-delta",
    source=KafkaSource(args.bootstrap, topics=args.topic, starting_offsets="earliest").load,
    transform=views,
    sink=DeltaSink(args.table, partition_by=["day"]),
    checkpoint=CheckpointConfig(args.checkpoint, interval="1 s"),
    restart_strategy=exponential_delay(initial_backoff="1 s", max_backoff="30 s"),
    stop_when_idle=args.stop_when_idle,
)
