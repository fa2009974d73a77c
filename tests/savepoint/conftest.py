"""Fixtures for the savepoint tests that need external systems: one tansu Kafka broker and one
PostgreSQL cluster with prepared transactions (the same helpers the source and sink tests use)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kafka_broker import KafkaBroker
from pg_cluster import PgCluster


@pytest.fixture(scope="session")
def sp_kafka() -> Iterator[str]:
    """Bootstrap address of a tansu broker with in-memory storage."""
    with KafkaBroker() as broker:
        yield broker.bootstrap


@pytest.fixture(scope="session")
def sp_pg() -> Iterator[PgCluster]:
    """PostgreSQL with max_prepared_transactions = 20 (two_phase sink)."""
    cluster = PgCluster(max_prepared_transactions=20, name="pg-savepoint")
    yield cluster
    cluster.destroy()
