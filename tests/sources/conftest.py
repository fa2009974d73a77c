"""Fixtures for source tests: one real Kafka-protocol broker (tansu) per test session."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from kafka_broker import KafkaBroker


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[str]:
    """Bootstrap address ``127.0.0.1:PORT`` of a tansu broker with in-memory storage."""
    with KafkaBroker() as broker:
        yield broker.bootstrap


@pytest.fixture
def topic_name() -> str:
    """A fresh topic name per test (the broker is shared by the whole session)."""
    return f"t-{uuid.uuid4().hex[:10]}"
