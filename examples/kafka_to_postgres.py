"""Example job: order events from Kafka -> the latest state of each order in PostgreSQL (upsert).

    pip install 'onceflow[kafka,postgres]'
    export ORDERS_DSN=postgresql://me:secret@db:5432/shop      # not in argv: ps shows argv
    onceflow run examples/kafka_to_postgres.py -- --bootstrap kafka:9092 --topic orders

Each record's value is JSON, ``{"order_id": 7, "status": "paid", "amount": 12.5}``. The table
(created if missing, primary key ``order_id``) holds one row per order: the last event of each
order in a batch wins, and each batch is merged in one PostgreSQL transaction decided with the
batch (two-phase commit: ``max_prepared_transactions`` > 0 on the server), so a crash and
replay never applies a batch twice. Arguments: ``--table`` (default ``orders``),
``--checkpoint`` (default ``example-out/kafka-to-postgres``), ``--stop-when-idle SECONDS``
(stop once the topic has had no new records that long; tests and backfills).
"""

import argparse
import os

from pyspark.sql import functions as F

from onceflow import CheckpointConfig, Job, KafkaSource, PostgresSink, exponential_delay

parser = argparse.ArgumentParser(prog="kafka_to_postgres.py")
parser.add_argument("--bootstrap", required=True, help="Kafka bootstrap servers")
parser.add_argument("--topic", default="orders")
parser.add_argument("--table", default="orders")
parser.add_argument("--checkpoint", default="example-out/kafka-to-postgres")
parser.add_argument("--stop-when-idle", type=float, default=None)
args = parser.parse_args()

ORDER = "order_id long, status string, amount double"


def latest_state(df):
    """Kafka records -> (order_id, status, amount, offset); the sink keeps the last per order."""
    order = F.from_json(F.col("value").cast("string"), ORDER)
    return df.select(order.alias("o"), "offset").select("o.*", "offset").where("order_id IS NOT NULL")


job = Job(
    name="kafka-to-postgres",
    source=KafkaSource(args.bootstrap, topics=args.topic, starting_offsets="earliest").load,
    transform=latest_state,
    sink=PostgresSink(os.environ["ORDERS_DSN"], table=args.table, write="upsert", keys=["order_id"],
                      create_table=True),
    checkpoint=CheckpointConfig(args.checkpoint, interval="1 s"),
    restart_strategy=exponential_delay(initial_backoff="1 s", max_backoff="30 s"),
    stop_when_idle=args.stop_when_idle,
)
