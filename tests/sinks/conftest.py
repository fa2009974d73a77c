"""Fixtures for sink tests: throwaway PostgreSQL 15 clusters (one per session each)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pg_cluster import PgCluster


@pytest.fixture(scope="session")
def pg() -> Iterator[PgCluster]:
    """PostgreSQL with max_prepared_transactions = 20; ``.dsn`` carries a password."""
    cluster = PgCluster(max_prepared_transactions=20, name="pg")
    yield cluster
    cluster.destroy()


@pytest.fixture(scope="session")
def pg_noprepared() -> Iterator[PgCluster]:
    """PostgreSQL with max_prepared_transactions = 0 (no two-phase commit)."""
    cluster = PgCluster(max_prepared_transactions=0, name="pg0")
    yield cluster
    cluster.destroy()


@pytest.fixture
def pg_up(pg: PgCluster) -> Iterator[PgCluster]:
    """``pg``, guaranteed running again after a test that stops it."""
    yield pg
    if not pg.is_running():
        pg.start()
