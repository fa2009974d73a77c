"""The job ``onceflow verify`` supervises: event ids -> (id, payload, checksum) -> the chosen sink.

Configured only by the spec file named in ``ONCEFLOW_VERIFY_SPEC`` (see
:mod:`onceflow.verify.spec`), so every driver incarnation, on any host, runs the same job.
"""

from __future__ import annotations

from onceflow import (
    CheckpointConfig,
    DeltaSink,
    IcebergSink,
    Job,
    KafkaSink,
    KafkaSource,
    PostgresSink,
    fixed_delay,
)
from onceflow.sinks.base import Sink
from onceflow.verify.spec import SALT, UPSERT_DELETE_SQL, VerifySpec, upsert_keys

#: payload(i) and crc32(payload(i)), as Spark SQL computes them from ``id``
PAYLOAD_SQL = f"substr(sha2(concat('{SALT}', CAST(id AS STRING)), 256), 1, 32)"


def source(spark):
    spec = VerifySpec.from_env()
    if spec.source == "kafka":
        per_batch = spec.rate  # every event is in the topic from the start: about --rate per second
        return KafkaSource(spec.kafka, topics=spec.input_topic, starting_offsets="earliest",
                           max_offsets_per_trigger=per_batch).load(spark)
    return (spark.readStream.format("onceflow-sequence")
            .option("total", spec.events).option("rows_per_second", spec.rate)
            .option("max_rows_per_batch", 2 * spec.rate).option("partitions", spec.partitions)
            .option("release_file", spec.release_file).load())


def transform(df):
    """Sequence: derive payload and checksum from the id. Kafka: parse ``id,payload,checksum``."""
    if "value" in df.columns:  # Kafka: the generator wrote the payload; carry it unchanged
        parts = "split(CAST(value AS STRING), ',')"
        df = df.selectExpr(f"CAST({parts}[0] AS BIGINT) AS id", f"{parts}[1] AS payload",
                           f"CAST({parts}[2] AS BIGINT) AS checksum").where("id >= 0")  # no sentinels
    else:
        df = df.selectExpr("id", f"{PAYLOAD_SQL} AS payload").selectExpr(
            "id", "payload", "crc32(payload) AS checksum")
    spec = VerifySpec.from_env()
    if spec.sink.endswith("-upsert"):
        return df.selectExpr(f"id % {upsert_keys(spec.events)} AS key", "id", "payload", "checksum")
    if spec.sink.startswith("kafka"):
        return df.selectExpr("CAST(id AS STRING) AS key",
                             "concat_ws(',', CAST(id AS STRING), payload, CAST(checksum AS STRING)) AS value")
    return df


def sink(spec: VerifySpec) -> Sink:
    if spec.sink == "delta-upsert":
        return DeltaSink(spec.table, sink_id=spec.sink_id, write="upsert", keys=["key"], order_by="id",
                         delete_when=UPSERT_DELETE_SQL)
    if spec.sink.startswith("delta"):
        return DeltaSink(spec.table, sink_id=spec.sink_id, writer="jvm" if spec.sink == "delta-jvm" else "arrow")
    if spec.sink == "iceberg":
        return IcebergSink(spec.iceberg_catalog, spec.table, sink_id=spec.sink_id)
    if spec.sink == "iceberg-upsert":
        return IcebergSink(spec.iceberg_catalog, spec.table, sink_id=spec.sink_id, write="upsert", keys=["key"],
                           order_by="id", delete_when=UPSERT_DELETE_SQL)
    if spec.sink.startswith("postgres"):
        mode = spec.sink.split("-", 1)[1]
        return PostgresSink(spec.postgres_job or spec.postgres, spec.table, mode=mode, create_table=True, sink_id=spec.sink_id,
                            commit_deadline=10.0)
    mode = "at_least_once" if spec.sink.endswith("at_least_once") else "exactly_once"
    return KafkaSink(spec.kafka, topic=spec.table, mode=mode, sink_id=spec.sink_id)


_spec = VerifySpec.from_env()
job = Job(
    name=f"verify-{_spec.name}",
    source=source,
    transform=transform,
    sink=sink(_spec),
    checkpoint=CheckpointConfig(_spec.checkpoint, interval="1 s"),
    restart_strategy=fixed_delay(attempts=1000, delay=0.5),
    stop_when_idle=4.0,
    master=_spec.master,
    spark_conf=dict(_spec.spark_conf),
)
