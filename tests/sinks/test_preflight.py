"""``onceflow run --dry-run``'s read-only sink checks (onceflow.sinks.preflight) against a real
PostgreSQL and a real Kafka broker: wrong targets are refused with the message a start would
give, right ones are reported, and nothing is created on the way (tables, log tables, topics).
The Delta sink's are in tests/cli/test_dry_run.py."""

from __future__ import annotations

import psycopg
import pytest
from pyspark.sql import types as T

from kafka_broker import KafkaBroker, create_topic
from onceflow.errors import ConfigError, SinkError
from onceflow.sinks.kafka.sink import KafkaSinkDataSource
from onceflow.sinks.postgres import PostgresDataSource
from onceflow.sinks.preflight import preflight

SCHEMA = T.StructType([T.StructField("id", T.LongType()), T.StructField("name", T.StringType())])


def tables(dsn: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        return {r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}


def test_postgres_preflight_reads_only(pg):
    before = tables(pg.dsn)
    with pytest.raises(ConfigError, match="table pre_absent does not exist"):
        preflight(PostgresDataSource({"dsn": pg.dsn, "table": "pre_absent"}), SCHEMA, False)
    lines = preflight(PostgresDataSource({"dsn": pg.dsn, "table": "pre_absent", "create_table": "true"}),
                      SCHEMA, False)
    assert any("reachable" in ln for ln in lines) and any("max_prepared_transactions" in ln for ln in lines)
    assert lines[-1] == "table pre_absent: absent, created from the stream's schema"
    assert tables(pg.dsn) == before  # neither the table nor onceflow's log tables were created

    with psycopg.connect(pg.dsn) as conn:
        conn.execute("CREATE TABLE pre_other (id bigint, label text)")
    with pytest.raises(ConfigError, match="do not match table pre_other"):
        preflight(PostgresDataSource({"dsn": pg.dsn, "table": "pre_other"}), SCHEMA, False)
    with pytest.raises(SinkError):  # nobody listens there
        preflight(PostgresDataSource({"dsn": "postgresql://u:p@127.0.0.1:1/db", "table": "t"}), SCHEMA, False)


def test_postgres_preflight_refuses_two_phase_without_prepared_transactions(pg_noprepared):
    with pytest.raises(ConfigError, match="max_prepared_transactions"):
        preflight(PostgresDataSource({"dsn": pg_noprepared.dsn, "table": "t", "create_table": "true"}),
                  SCHEMA, False)


def test_kafka_preflight_reads_only():
    schema = T.StructType([T.StructField("value", T.StringType())])
    with KafkaBroker() as broker:
        opts = {"bootstrap_servers": broker.bootstrap, "topic": "pre-out", "timeout": "10"}
        with pytest.raises(ConfigError, match="topic pre-out does not exist"):
            preflight(KafkaSinkDataSource(opts), schema, False)
        create_topic(broker.bootstrap, "pre-out", partitions=2)
        lines = preflight(KafkaSinkDataSource(opts), schema, False)
        assert "topic pre-out: 2 partition(s)" in lines[0]
        assert any(ln.startswith("marker_topic:") and "missing" in ln for ln in lines)
        assert "aborted-record probe: not run" in lines[-1]
        with pytest.raises(ConfigError, match="no 'value' column"):
            preflight(KafkaSinkDataSource(opts), SCHEMA, False)
        from confluent_kafka.admin import AdminClient

        topics = AdminClient({"bootstrap.servers": broker.bootstrap}).list_topics(timeout=10).topics
        assert "__onceflow_markers" not in topics  # a start creates it; the dry run does not
