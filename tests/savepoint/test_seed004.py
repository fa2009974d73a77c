"""seeds/004's case on real systems: a Kafka -> two_phase PostgreSQL job is cancelled with a
savepoint, more records arrive while it is stopped ("hours later"), and the job restored from
the savepoint resumes exactly at the saved Kafka offsets — although its source is now
configured with ``starting_offsets="latest"`` — with no loss and no duplicate."""

from __future__ import annotations

import threading
import time
import uuid

import psycopg

from kafka_broker import create_topic, produce
from onceflow.checkpoint.layout import CheckpointDir
from onceflow.job import CheckpointConfig, Job
from onceflow.runtime.restart import fixed_delay
from onceflow.savepoint import inspect_savepoint
from onceflow.savepoint.operations import SAVEPOINT_DIR_ENV, savepoint_on_stop
from onceflow.sinks.postgres import PostgresSink
from onceflow.sources.kafka import KafkaSource


def kafka_to_pg(tmp_path, bootstrap, topic, pg, table, starting, per_batch, ckpt="ckpt", idle=None) -> Job:
    def source(spark):
        return KafkaSource(bootstrap, topics=topic, starting_offsets=starting,
                           max_offsets_per_trigger=per_batch).load(spark)

    return Job(name="seed004", source=source,
               transform=lambda df: df.selectExpr("CAST(CAST(value AS STRING) AS BIGINT) AS id",
                                                  "partition", "offset"),
               sink=PostgresSink(pg.dsn, table=table, mode="two_phase", create_table=True,
                                 sink_id=table),
               checkpoint=CheckpointConfig(str(tmp_path / ckpt), interval=0),
               restart_strategy=fixed_delay(attempts=1, delay=0), stop_when_idle=idle)


def query(pg, q: str, *args):
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        return conn.execute(q, args).fetchall()


def test_cancel_with_savepoint_resume_hours_later_at_the_saved_kafka_offsets(spark, sp_kafka, sp_pg, tmp_path):
    topic, table = f"t-{uuid.uuid4().hex[:8]}", f"seed004_{uuid.uuid4().hex[:8]}"
    create_topic(sp_kafka, topic, 2)
    produce(sp_kafka, topic, [str(i) for i in range(3000)], partitions=2)

    # Run, and cancel with a savepoint while records are still waiting (100 per batch: 30
    # batches, so the cancel after three cannot come after the last however fast they run).
    job = kafka_to_pg(tmp_path, sp_kafka, topic, sp_pg, table, "earliest", 100)
    ckpt = CheckpointDir(job.checkpoint.directory)
    stop, started = threading.Event(), time.time()

    def cancel_after_three_batches() -> None:  # what SIGTERM does in the driver
        deadline = time.monotonic() + 120
        while len(ckpt.committed_batches()) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        stop.set()

    threading.Thread(target=cancel_after_three_batches, daemon=True).start()
    job.run(spark=spark, stop=stop)  # Spark calls stay on the main thread
    assert len(ckpt.committed_batches()) >= 3
    sp, manifest = savepoint_on_stop(ckpt.url, job.name, started, {SAVEPOINT_DIR_ENV: str(tmp_path / "sps")})
    assert sp.startswith(str(tmp_path / "sps" / f"seed004-{manifest.batch}-"))
    assert inspect_savepoint(sp).verified is True
    saved = manifest.source_offsets[0][topic]
    assert 0 < sum(saved.values()) < 3000  # cancelled mid-stream

    # "Hours later": 200 more records arrived; the job is redeployed reading from 'latest'.
    produce(sp_kafka, topic, [str(i) for i in range(3000, 3200)], partitions=2)
    resumed = kafka_to_pg(tmp_path, sp_kafka, topic, sp_pg, table, "latest", 1000, ckpt="ckpt2", idle=1.0)
    resumed.run(spark=spark, from_savepoint=sp)
    c2 = CheckpointDir(resumed.checkpoint.directory)
    assert c2.lineage == manifest.lineage
    # The first batch after the savepoint started exactly at the saved offsets ...
    first = c2.offset_batches()[c2.offset_batches().index(manifest.batch) + 1]
    assert c2.source_offsets(first - 1)[0][topic] == saved
    # ... so PostgreSQL holds every id exactly once (none lost to 'latest', none twice).
    n, distinct, lo, hi = query(sp_pg, f"SELECT count(*), count(DISTINCT id), min(id), max(id) FROM {table}")[0]
    assert (n, distinct, lo, hi) == (3200, 3200, 0, 3199)
    assert query(sp_pg, "SELECT count(*) FROM pg_prepared_xacts WHERE gid LIKE %s", f"onceflow:{table}:%") == [(0,)]
