"""verify's TCP fault proxy against a real PostgreSQL: it passes traffic unchanged, a lost
reply means the server acted and the client only saw its connection die, and a partition
resets live connections and refuses new ones until it heals."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from onceflow.verify.proxy import FaultProxy
from pg_cluster import PgCluster


@pytest.fixture(scope="module")
def pg():
    cluster = PgCluster(max_prepared_transactions=5, name="pgproxy")
    with psycopg.connect(cluster.dsn, autocommit=True) as c:
        c.execute("CREATE TABLE t (i int)")
    yield cluster
    cluster.destroy()


@pytest.fixture
def proxy(pg):
    p = FaultProxy(("127.0.0.1", pg.port), "postgres")
    yield p, make_conninfo(pg.dsn, host="127.0.0.1", port=str(p.port), sslmode="disable",
                           gssencmode="disable", connect_timeout="5")
    p.close()


def _in_background(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("result", fn()), daemon=True)
    t.start()
    time.sleep(0.2)
    return t, out


def test_traffic_passes_unchanged(proxy):
    _, dsn = proxy
    with psycopg.connect(dsn) as c:
        assert c.execute("SELECT %s::text, repeat('x', 100000)", ["é"]).fetchone() == ("é", "x" * 100000)


def test_a_lost_reply_commits_and_the_client_never_hears(pg, proxy):
    p, dsn = proxy
    t, out = _in_background(lambda: p.lose_replies([0, 1, 0], timeout=20))
    conn = psycopg.connect(dsn, autocommit=True)
    with pytest.raises(psycopg.OperationalError):
        with conn.transaction():  # BEGIN ... COMMIT as a simple query
            conn.execute("INSERT INTO t VALUES (%s)", [1])
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute("BEGIN")
    conn.execute("INSERT INTO t VALUES (2)")
    conn.execute("PREPARE TRANSACTION 'g1'")  # let through (skip 1)
    conn.execute("BEGIN")
    conn.execute("INSERT INTO t VALUES (3)")
    with pytest.raises(psycopg.OperationalError):
        conn.execute("PREPARE TRANSACTION 'g2'")
    conn = psycopg.connect(dsn, autocommit=True)
    with pytest.raises(psycopg.OperationalError):
        conn.execute("COMMIT PREPARED 'g1'")  # extended protocol (Parse/Bind/Execute/Sync)
    t.join(30)
    assert out["result"] == ["COMMIT (PostgreSQL answered COMMIT)",
                             "PREPARE TRANSACTION 'g2' (PostgreSQL answered PREPARE TRANSACTION)",
                             "COMMIT PREPARED 'g1' (PostgreSQL answered COMMIT PREPARED)"]
    with psycopg.connect(pg.dsn, autocommit=True) as c:  # the server did act on each
        assert sorted(r[0] for r in c.execute("SELECT i FROM t")) == [1, 2]
        assert [r[0] for r in c.execute("SELECT gid FROM pg_prepared_xacts")] == ["g2"]
        c.execute("ROLLBACK PREPARED 'g2'")
        c.execute("TRUNCATE t")
    with psycopg.connect(dsn) as c:  # disarmed: commits pass again
        c.execute("INSERT INTO t VALUES (9)")
    with psycopg.connect(pg.dsn) as c:
        assert c.execute("SELECT count(*) FROM t WHERE i = 9").fetchone() == (1,)


def test_a_partition_cuts_refuses_and_heals(proxy):
    p, dsn = proxy
    live = psycopg.connect(dsn, autocommit=True)
    t, out = _in_background(lambda: p.partition(2.0))
    with pytest.raises(psycopg.OperationalError):
        live.execute("SELECT 1")
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(dsn)
    t.join(10)
    assert out["result"] == (1, 1)  # one connection cut, one refused
    with psycopg.connect(dsn) as c:
        assert c.execute("SELECT 42").fetchone() == (42,)
