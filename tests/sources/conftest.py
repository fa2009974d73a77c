"""Fixtures for source tests: one real Kafka-protocol broker (tansu) and one kinesalite server
per test session, and a PostgreSQL cluster for the Kinesis -> PostgreSQL tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from kafka_broker import KafkaBroker
from kinesis_server import Kinesalite
from pg_cluster import PgCluster


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[str]:
    """Bootstrap address ``127.0.0.1:PORT`` of a tansu broker with in-memory storage."""
    with KafkaBroker() as broker:
        yield broker.bootstrap


@pytest.fixture
def topic_name() -> str:
    """A fresh topic name per test (the broker is shared by the whole session)."""
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def kinesalite() -> Iterator[Kinesalite]:
    """A kinesalite server (the Kinesis API, in memory) with instant stream changes."""
    with Kinesalite() as server:
        yield server


@pytest.fixture(scope="session")
def kinesis_pg() -> Iterator[PgCluster]:
    """PostgreSQL with max_prepared_transactions = 20 for the Kinesis -> two_phase tests."""
    cluster = PgCluster(max_prepared_transactions=20, name="pg-kinesis")
    yield cluster
    cluster.destroy()


@pytest.fixture
def stream_name() -> str:
    """A fresh stream name per test (the server is shared by the whole session)."""
    return f"s-{uuid.uuid4().hex[:10]}"
