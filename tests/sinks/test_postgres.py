"""PostgreSQL sink: exactly-once through the crash windows of docs/protocol.md section 5 (real Spark, real PostgreSQL)."""

from __future__ import annotations

import json
import logging
import signal
import time
import uuid
from datetime import date, timedelta
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest

from onceflow.errors import ConfigError, FencedError, SinkError
from onceflow.sinks.base import Decision
from onceflow.sinks.postgres import PostgresSink

TOTAL, PER_BATCH = 2000, 1000
TASK_POINTS = ("before_precommit", "after_precommit")
DRIVER_POINTS = ("before_decide", "after_decide", "mid_commit", "after_commit")


def uid() -> str:
    return uuid.uuid4().hex[:8]


def seq(spark, total: int, per_batch: int, partitions: int = 2):
    return (
        spark.readStream.format("onceflow-sequence")
        .option("total", total).option("rows_per_second", 10_000_000)
        .option("max_rows_per_batch", per_batch).option("partitions", partitions)
        .load()
    )


def end_offset(progress) -> int | None:
    src = progress["sources"][0] if not hasattr(progress, "sources") else progress.sources[0]
    raw = src["endOffset"] if isinstance(src, dict) else src.endOffset
    raw = json.loads(raw) if isinstance(raw, str) else raw
    return int(raw["next"]) if raw else None


def run_stream(spark, tmp_path, sink: PostgresSink, total=TOTAL, per_batch=PER_BATCH, partitions=2,
               crash: str | None = None, transform=None, timeout: float = 90,
               raw_dsn: str | None = None) -> str | None:
    """Run until ``total`` ids are committed or the query fails; return the failure text.

    ``raw_dsn``: pass this DSN (password included) as the plain ``dsn`` option instead of
    the ``dsn`` + ``password`` options that ``PostgresSink.options()`` produces."""
    opts = sink.options()
    if raw_dsn:
        opts = {k: v for k, v in opts.items() if k != "password"} | {"dsn": raw_dsn}
    if crash:
        (tmp_path / "markers").mkdir(parents=True, exist_ok=True)
        opts |= {"test_crash_at": crash, "test_crash_markers": str(tmp_path / "markers")}
    df = seq(spark, total, per_batch, partitions)
    if transform is not None:
        df = transform(df)
    query = (
        df.writeStream.format("onceflow-postgres").options(**opts)
        .option("checkpointLocation", str(tmp_path / "ckpt")).start()
    )
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not query.isActive:
                break
            if any(end_offset(p) == total for p in query.recentProgress):
                return None
            time.sleep(0.1)
        else:
            raise AssertionError(f"query did not finish {total} rows in {timeout}s")
    finally:
        query.stop()
    exc = query.exception()
    return None if exc is None else str(exc)


def rows(pg, q: str, *args):
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        return conn.execute(q, args).fetchall()


def execute(pg, q: str) -> None:
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        conn.execute(q)


def prepared(pg, sink_id: str) -> list[str]:
    return [r[0] for r in rows(pg, "SELECT gid FROM pg_prepared_xacts WHERE gid LIKE %s ORDER BY gid", f"onceflow:{sink_id}:%")]


def assert_exactly_once(pg, table: str, total: int, sink_id: str) -> None:
    n, distinct, lo, hi = rows(pg, f"SELECT count(*), count(DISTINCT id), min(id), max(id) FROM {table}")[0]
    assert (n, distinct, lo, hi) == (total, total, 0, total - 1), f"rows={n} distinct={distinct} range={lo}..{hi}"
    assert prepared(pg, sink_id) == []


def make_sink(pg, mode="two_phase", **kw) -> PostgresSink:
    sid = kw.pop("sink_id", f"s{uid()}")
    return PostgresSink(pg.dsn, table=kw.pop("table", f"t_{sid}"), mode=mode, create_table=True,
                        commit_deadline=kw.pop("commit_deadline", 20), sink_id=sid, **kw)


# ---- happy paths -----------------------------------------------------------------------------


def server_for(mode, pg, pg_noprepared):
    return pg if mode == "two_phase" else pg_noprepared


def decided_batches(server, sink_id: str) -> list[int]:
    return [b for (b,) in rows(server, "SELECT batch_id FROM onceflow_commit_log WHERE sink = %s ORDER BY 1", sink_id)]


@pytest.mark.parametrize("mode", ["two_phase", "idempotent"])
def test_append_exactly_once_and_restart_continues(spark, pg, pg_noprepared, tmp_path, mode):
    server = server_for(mode, pg, pg_noprepared)
    sink = make_sink(server, mode)
    assert run_stream(spark, tmp_path, sink) is None
    assert_exactly_once(server, sink.table, TOTAL, sink.sink_id)
    first = decided_batches(server, sink.sink_id)
    assert run_stream(spark, tmp_path, sink, total=TOTAL + 1500) is None
    assert_exactly_once(server, sink.table, TOTAL + 1500, sink.sink_id)
    batches = decided_batches(server, sink.sink_id)
    assert batches == list(range(len(batches))) and len(batches) > len(first)
    assert rows(server, "SELECT count(*) FROM onceflow_markers WHERE sink = %s", sink.sink_id) == [(0,)]


def by_key(df):
    return df.selectExpr("id % 100 AS k", "id AS v", "concat('v', id) AS label")


def expected_upsert(total: int) -> list[tuple]:
    return [(k, total - 100 + k, f"v{total - 100 + k}") for k in range(100)]


@pytest.mark.parametrize("mode", ["two_phase", "idempotent"])
def test_upsert_last_row_per_key_wins_through_a_task_crash(spark, pg, pg_noprepared, tmp_path, mode):
    """Keys repeat within and across batches. The failed attempt's prepared transaction holds
    row locks on every key: the retried attempt must roll it back, not wait for it."""
    server = server_for(mode, pg, pg_noprepared)
    sink = make_sink(server, mode, write="upsert", keys=["k"])
    assert run_stream(spark, tmp_path, sink, partitions=1, transform=by_key, crash="after_precommit@2:raise") is None
    assert list((tmp_path / "markers").iterdir())
    assert rows(server, f"SELECT k, v, label FROM {sink.table} ORDER BY k") == expected_upsert(TOTAL)
    assert prepared(server, sink.sink_id) == []


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["two_phase", "idempotent"])
def test_upsert_keys_colliding_across_partitions_last_row_wins(spark, pg, pg_noprepared, tmp_path, mode):
    """Every key appears in both partitions of every batch. Tasks only stage their rows; the
    driver merges a decided batch, the last row per key in (partition, position) order winning.
    (Tasks upserting into the table directly hang in two_phase: the second task waits on the
    first one's prepared transaction.) A driver crash between decision and merge leaves the
    batch staged and invisible; recovery (here: doctor's resolve) merges it exactly once."""
    from onceflow.sinks.postgres.doctor import resolve

    db = Database(server_for(mode, pg, pg_noprepared), f"upsert_{uid()}")
    sink = make_sink(db, mode, write="upsert", keys=["k"])

    def transform(df):  # values fall as ids rise: a winner chosen by value would be wrong
        return df.selectExpr("id % 100 AS k", "-id AS v", "concat('v', id) AS label")

    def expected(total: int) -> list[tuple]:
        return [(k, -(total - 100 + k), f"v{total - 100 + k}") for k in range(100)]

    point = "mid_commit" if mode == "two_phase" else "after_decide"
    err = run_stream(spark, tmp_path, sink, partitions=2, transform=transform, timeout=60, crash=f"{point}@1:raise")
    assert err and "InjectedCrash" in err
    # batch 0 is empty, batch 1 (ids 0..999) is decided but staged: nothing visible yet
    assert rows(db, f"SELECT count(*) FROM {sink.table}") == [(0,)]
    report = resolve(db.dsn)
    assert (report.committed, report.merged, report.skipped) == (1 if mode == "two_phase" else 0, 1, [])
    assert rows(db, f"SELECT k, v, label FROM {sink.table} ORDER BY k") == expected(1000)
    assert run_stream(spark, tmp_path, sink, total=3000, partitions=2, transform=transform, timeout=60) is None
    assert rows(db, f"SELECT k, v, label FROM {sink.table} ORDER BY k") == expected(3000)
    assert prepared(db, sink.sink_id) == []
    stage = sink.data_source().stage_table.as_string()
    assert rows(db, f"SELECT count(*) FROM {stage}") == [(0,)]


def test_prepared_transactions_of_a_dead_driver_are_rolled_back_by_the_next_run(spark, pg, tmp_path):
    """A driver killed after its tasks pre-committed leaves undecided prepared transactions
    (here: one holding row locks on every key). The next run must roll them back and finish."""
    sink = make_sink(pg, write="upsert", keys=["k"])
    assert run_stream(spark, tmp_path, sink, total=1000, partitions=1, transform=by_key) is None
    lineage = json.loads((tmp_path / "ckpt" / "metadata").read_text())["id"]
    dead = f"onceflow:{sink.sink_id}:{lineage}:2:0:0:dead-run"
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        conn.execute("BEGIN")
        conn.execute(f"UPDATE {sink.table} SET v = -1")
        conn.execute(f"PREPARE TRANSACTION '{dead}'")
    assert run_stream(spark, tmp_path, sink, partitions=1, transform=by_key, timeout=60) is None
    assert rows(pg, f"SELECT k, v, label FROM {sink.table} ORDER BY k") == expected_upsert(TOTAL)
    assert prepared(pg, sink.sink_id) == []


@pytest.mark.parametrize("with_decimal", [False, True], ids=["binary-copy", "csv-copy"])
def test_type_mapping_and_values_round_trip(spark, pg, tmp_path, with_decimal):
    """Every mapped type arrives intact, through binary COPY and (decimals present) CSV COPY."""
    sink = make_sink(pg)
    decimal_col = ["cast(id AS decimal(12,2)) / 8 AS n"] if with_decimal else []

    def transform(df):
        return df.selectExpr(
            "id", "cast(id AS int) AS i", "cast(id % 100 AS smallint) AS sm", "id % 2 = 0 AS b",
            "cast(id AS double) / 4 AS d", "cast(id AS float) AS f",
            "CASE WHEN id % 3 = 0 THEN NULL WHEN id % 3 = 1 THEN '' ELSE concat('a,\"q\"é', chr(10), id) END AS s",
            *decimal_col, "CASE WHEN id % 5 = 0 THEN NULL ELSE cast(concat('x', id) AS binary) END AS bin",
            "date_add(DATE'1990-01-01', cast(id * 40 AS int)) AS day", "event_time",
        )

    assert run_stream(spark, tmp_path, sink, total=300, per_batch=300, transform=transform) is None
    types = dict(rows(pg, "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = %s", sink.table))
    assert types == {
        "id": "bigint", "i": "integer", "sm": "smallint", "b": "boolean", "d": "double precision",
        "f": "real", "s": "text", "bin": "bytea", "day": "date", "event_time": "timestamp with time zone",
    } | ({"n": "numeric"} if with_decimal else {})
    got = {r[0]: r[1:] for r in rows(
        pg, f"SELECT id, i, sm, b, d, f, s, bin, day::text, extract(epoch FROM event_time) FROM {sink.table}")}
    assert len(got) == 300
    for i in (0, 1, 2, 5, 299):
        s = None if i % 3 == 0 else "" if i % 3 == 1 else f'a,"q"é\n{i}'
        assert got[i][:6] == (i, i % 100, i % 2 == 0, i / 4, float(i), s)
        assert got[i][6] == (None if i % 5 == 0 else f"x{i}".encode())
        assert got[i][7] == str(date(1990, 1, 1) + timedelta(days=i * 40))
        assert got[i][8] == Decimal(i) / 1000  # event_time = id milliseconds after the epoch
    if with_decimal:
        assert rows(pg, f"SELECT n FROM {sink.table} WHERE id = 299") == [(Decimal("37.375"),)]  # Spark widens the scale of the division


# ---- crash windows (docs/protocol.md section 5) -------------------------------------------------


# The crash-window matrix (raise in each window, restart in-process) runs against every sink in
# tests/sinks/test_conformance.py; real SIGKILLs of the driver in each window are below.


KILL_JOB = """
import logging
import os
from onceflow import CheckpointConfig, Job, PostgresSink, fixed_delay

job = Job(
    name="pg-kill",
    source=lambda spark: spark.readStream.format("onceflow-sequence")
        .option("total", int(os.environ["TOTAL"])).option("rows_per_second", 10**9)
        .option("max_rows_per_batch", int(os.environ["PER_BATCH"])).option("partitions", 2).load(),
    sink=PostgresSink(os.environ["DSN"], os.environ["TABLE"], mode=os.environ["MODE"], create_table=True,
                      sink_id=os.environ["SINK_ID"], commit_deadline=20),
    checkpoint=CheckpointConfig(os.environ["CKPT"], interval=0),
    restart_strategy=fixed_delay(attempts=6, delay=0),
    stop_when_idle=2.0,
    master="local[2]",
)
"""


@pytest.mark.slow
@pytest.mark.timeout(660)  # two driver starts; a few minutes on a loaded 2-core machine
def test_driver_sigkilled_in_each_window_restarts_exactly_once(pg, pg_noprepared, tmp_path):
    """Real driver deaths: ``onceflow run`` (the supervisor) runs the job; a fault point SIGKILLs the
    driver's whole process group (two_phase: one of two prepared transactions committed;
    idempotent: decided). Each restart recovers on
    open: decided prepared transactions are committed, and the table ends exactly-once with no
    prepared transaction left. Both modes run side by side. Every window, with in-process
    restarts, is in the conformance suite."""
    import os
    import subprocess
    import sys

    from onceflow.checkpoint.eventlog import EventLog

    total, per_batch = 3000, 500
    plans = {
        # The windows whose recovery differs after a process death: a decided batch rolled
        # forward half-committed (two_phase) and whole (idempotent). Every window, with in-process
        # restarts, is in the conformance suite.
        "two_phase": (pg, ["mid_commit@1"]),
        "idempotent": (pg_noprepared, ["after_decide@1"]),
    }
    procs, sinks = {}, {}
    try:
        for mode, (server, points) in plans.items():
            d = tmp_path / mode
            (d / "markers").mkdir(parents=True)
            (d / "job.py").write_text(KILL_JOB)
            sinks[mode] = sid = f"k{uid()}"
            env = {
                **os.environ, "MODE": mode, "TOTAL": str(total), "PER_BATCH": str(per_batch),
                "DSN": server.dsn, "TABLE": f"t_{sid}", "SINK_ID": sid, "CKPT": str(d / "ckpt"),
                "ONCEFLOW_CRASH_AT": ",".join(f"{p}:kill" for p in points),
                "ONCEFLOW_CRASH_MARKER_DIR": str(d / "markers"),
            }
            with open(d / "out.log", "w") as out:
                procs[mode] = subprocess.Popen(
                    [str(Path(sys.executable).parent / "onceflow"), "run", str(d / "job.py"), "--no-standby"],
                    env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                )
        for p in procs.values():
            p.wait(timeout=600)
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for mode, (server, points) in plans.items():
        d, sid = tmp_path / mode, sinks[mode]
        out = (d / "out.log").read_text()
        assert procs[mode].returncode == 0, out[-3000:]
        fired = sorted(f.name for f in (d / "markers").iterdir())
        assert fired == sorted(f"fired-{p.replace('@', '-')}" for p in points)
        restarts = [e["cause"] for e in EventLog(str(d / "ckpt")).read() if e["event"] == "restart"]
        assert restarts == ["killed by SIGKILL"] * len(points), out[-3000:]
        assert_exactly_once(server, f"t_{sid}", total, sid)
        decided = decided_batches(server, sid)
        assert decided == list(range(len(decided))) and len(decided) >= total // per_batch
        assert rows(server, "SELECT count(*) FROM onceflow_markers WHERE sink = %s", sid) == [(0,)]
        assert server.password not in out
        if mode == "two_phase":  # recovery on open committed the half-committed batch's other half
            assert "'committed': 1" in out, out[-3000:]


def test_postgres_restart_with_prepared_transactions_pending(spark, pg_up, tmp_path):
    pg = pg_up
    sink = make_sink(pg)
    err = run_stream(spark, tmp_path, sink, crash="after_decide@1:raise")
    assert err and "InjectedCrash" in err
    before = prepared(pg, sink.sink_id)
    assert len(before) == 2
    pg.restart(fast=True)
    assert prepared(pg, sink.sink_id) == before  # PREPARE TRANSACTION is durable
    assert run_stream(spark, tmp_path, sink) is None
    assert_exactly_once(pg, sink.table, TOTAL, sink.sink_id)


def test_postgres_down_longer_than_commit_deadline(spark, pg_up, tmp_path):
    """The decided batch survives an outage longer than the deadline: the query fails
    (restart strategy), and the restart after PostgreSQL is back commits it."""
    pg = pg_up
    sink = make_sink(pg, commit_deadline=2)
    err = run_stream(spark, tmp_path, sink, crash="after_decide@1:raise")
    assert err and "InjectedCrash" in err
    decision = sink.data_source().decision(lineage := rows(pg, "SELECT lineage FROM onceflow_commit_log WHERE sink = %s AND batch_id = 1", sink.sink_id)[0][0], 1)
    assert decision is not None and len(decision.handles) == 2
    pg.stop()
    started = time.monotonic()
    with pytest.raises(SinkError) as e:
        sink.data_source().commit(decision)  # the driver's commit step, retried until the deadline
    assert 2 <= time.monotonic() - started < 15
    assert "127.0.0.1" in str(e.value) and pg.password not in str(e.value)
    err = run_stream(spark, tmp_path, sink)  # restart while still down: fails, loses nothing
    assert err and "SinkError" in err and pg.password not in err
    pg.start()
    assert len(prepared(pg, sink.sink_id)) == 2
    assert run_stream(spark, tmp_path, sink) is None
    assert_exactly_once(pg, sink.table, TOTAL, sink.sink_id)
    assert lineage


# ---- fence, recovery, fingerprint -------------------------------------------------------------


def test_second_opener_takes_over_and_open_recovers(spark, pg, tmp_path):
    """(Replaces the advisory-lock fence test.) open() takes a new epoch and recovers; a second
    opener of the same lineage is not refused: it takes over, and the first driver is fenced at
    its next decide. Other lineages have epochs of their own."""
    sink = make_sink(pg)
    err = run_stream(spark, tmp_path, sink, crash="after_decide@1:raise")
    assert err and "InjectedCrash" in err
    lineage = json.loads((tmp_path / "ckpt" / "metadata").read_text())["id"]
    first = sink.data_source({"checkpointlocation": str(tmp_path / "ckpt")})
    e1 = first.open(lineage)
    assert first.recovered == {"committed": 2, "rolled_back": 0}
    assert rows(pg, f"SELECT count(*) FROM {sink.table}") == [(1000,)]
    second = sink.data_source()
    assert second.open(lineage) == e1 + 1
    assert second.recovered == {"committed": 0, "rolled_back": 0}
    with pytest.raises(FencedError, match=f"holds epoch {e1} of lineage {lineage}, but epoch {e1 + 1} has opened") as e:
        first.decide(Decision(lineage, 2, "fp", [], e1), _kv(), False)
    assert pg.password not in str(e.value)
    assert first.decision(lineage, 2) is None
    assert sink.data_source().open(str(uuid.uuid4())) == 1  # other lineages are not fenced


def test_job_runner_opens_the_fence_and_recovers_after_driver_crash(spark, pg, tmp_path):
    from onceflow.job import CheckpointConfig, Job
    from onceflow.runtime.restart import fixed_delay

    sink = make_sink(pg)
    opts = sink.options() | {"test_crash_at": "after_decide@1:raise", "test_crash_markers": str(tmp_path)}
    sink.options = lambda: opts  # type: ignore[method-assign]
    Job(
        name="pgjob", source=lambda s: seq(s, TOTAL, PER_BATCH), sink=sink,
        checkpoint=CheckpointConfig(str(tmp_path / "ckpt"), interval=0),
        restart_strategy=fixed_delay(attempts=3, delay=0), stop_when_idle=1.0,
    ).run(spark=spark)
    assert list(tmp_path.glob("fired-*"))
    assert_exactly_once(pg, sink.table, TOTAL, sink.sink_id)
    logged = "".join(p.read_text() for p in (tmp_path / "ckpt").rglob("*") if p.is_file() and "events" in p.name)
    assert pg.password not in logged


def test_fingerprint_mismatch_stops_with_clear_error(spark, pg, tmp_path):
    """Rolling the checkpoint back to an older copy and replanning batches differently while
    keeping the lineage is refused, not silently skipped."""
    import shutil

    sink = make_sink(pg)
    assert run_stream(spark, tmp_path, sink, total=1000) is None
    shutil.copytree(tmp_path / "ckpt", tmp_path / "old")
    assert run_stream(spark, tmp_path, sink, total=TOTAL) is None
    shutil.rmtree(tmp_path / "ckpt")
    shutil.copytree(tmp_path / "old", tmp_path / "ckpt")
    err = run_stream(spark, tmp_path, sink, total=TOTAL, per_batch=700)
    assert err and "FingerprintMismatch" in err and "--fork" in err
    assert_exactly_once(pg, sink.table, TOTAL, sink.sink_id)


# ---- bad inputs and secrets -----------------------------------------------------------------


def stream_schema(spark):
    return seq(spark, 10, 10).schema


def test_unreachable_and_wrong_password_name_the_server_not_the_password(spark, pg):
    schema = stream_schema(spark)
    dead = PostgresSink(f"postgresql://postgres:{pg.password}@127.0.0.1:1/postgres", table="t")
    with pytest.raises(SinkError, match=r"127\.0\.0\.1:1/postgres") as e:
        dead.data_source().validate(schema, False)
    assert pg.password not in str(e.value)
    wrong = PostgresSink(pg.dsn.replace(pg.password, "nope-" + pg.password[::-1]), table="t")
    with pytest.raises(ConfigError, match="password") as e:
        wrong.data_source().validate(schema, False)
    assert pg.password[::-1] not in str(e.value)


def test_missing_table_mismatched_columns_and_upsert_keys(spark, pg):
    schema = stream_schema(spark)
    name = f"t_{uid()}"
    with pytest.raises(ConfigError, match="create_table=True"):
        PostgresSink(pg.dsn, table=name).data_source().validate(schema, False)
    execute(pg, f"CREATE TABLE {name} (id text, key bigint, extra int NOT NULL)")
    with pytest.raises(ConfigError) as e:
        PostgresSink(pg.dsn, table=name).data_source().validate(schema, False)
    msg = str(e.value)
    assert "id (stream bigint, table text)" in msg and "event_time (not in the table)" in msg and "extra" in msg
    execute(pg, f"CREATE TABLE {name}_ok (id bigint, key bigint, event_time timestamptz)")
    PostgresSink(pg.dsn, table=f"{name}_ok").data_source().validate(schema, False)
    with pytest.raises(ConfigError, match="primary key or unique index"):
        PostgresSink(pg.dsn, table=f"{name}_ok", write="upsert", keys=["id"]).data_source().validate(schema, False)


def test_narrowing_and_unsupported_types_are_refused_up_front(spark, pg):
    from pyspark.sql import types as T

    name = f"t_{uid()}"
    execute(pg, f"CREATE TABLE {name} (id bigint, n numeric(5,2), m numeric(14,2), w numeric, s varchar(3))")
    schema = T.StructType([T.StructField("id", T.LongType()), T.StructField("n", T.DecimalType(12, 2)),
                           T.StructField("m", T.DecimalType(12, 2)), T.StructField("w", T.DecimalType(30, 9)),
                           T.StructField("s", T.StringType())])
    with pytest.raises(ConfigError) as e:
        PostgresSink(pg.dsn, table=name).data_source().validate(schema, False)
    msg = str(e.value)
    assert "n (stream numeric(12,2), table numeric(5,2))" in msg and "m (" not in msg and "w (" not in msg
    assert "\n" not in msg
    for nested in (T.ArrayType(T.LongType()), T.MapType(T.StringType(), T.LongType()),
                   T.StructType([T.StructField("a", T.LongType())])):
        bad = T.StructType([T.StructField("id", T.LongType()), T.StructField("x", nested)])
        with pytest.raises(ConfigError, match=r"Spark type (array|map|struct)<.*> is not supported; cast it"):
            PostgresSink(pg.dsn, table=f"t_{uid()}", create_table=True).data_source().validate(bad, False)


def test_value_too_long_for_the_column_fails_clearly_and_commits_nothing(spark, pg, tmp_path):
    """Text into varchar(3) passes validation (the stream has no lengths); a longer value
    fails its task with a one-line error naming the table, type and column; nothing is kept."""
    sink = make_sink(pg)
    execute(pg, f"CREATE TABLE {sink.table} (id bigint, label varchar(3))")
    err = run_stream(spark, tmp_path, sink, total=100, per_batch=100,
                     transform=lambda df: df.selectExpr("id", "concat('val', id) AS label"))
    assert err and f"does not fit table {sink.table}: value too long for type character varying(3)" in err
    assert "column label" in err and "val99" not in err
    assert rows(pg, f"SELECT count(*) FROM {sink.table}") == [(0,)] and prepared(pg, sink.sink_id) == []


def test_no_free_prepared_transaction_slot_fails_clearly(spark, pg, tmp_path):
    """max_prepared_transactions = 20, 19 taken by someone else, 2 write partitions: a task
    fails with an error naming the setting and the remedies; nothing is committed or left."""
    slots = int(rows(pg, "SHOW max_prepared_transactions")[0][0])
    fillers = [f"filler-{uid()}-{i}" for i in range(slots - 1 - len(rows(pg, "SELECT 1 FROM pg_prepared_xacts")))]
    try:
        for gid in fillers:
            with psycopg.connect(pg.dsn, autocommit=True) as conn:
                conn.execute("BEGIN")
                conn.execute(f"PREPARE TRANSACTION '{gid}'")
        sink = make_sink(pg)
        err = run_stream(spark, tmp_path, sink, total=200, per_batch=200)
    finally:
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            for gid in fillers:
                conn.execute(f"ROLLBACK PREPARED '{gid}'")
    assert err and "no free prepared-transaction slot" in err and "max_prepared_transactions" in err
    assert "coalesce()" in err and pg.password not in err
    assert rows(pg, f"SELECT count(*) FROM {sink.table}") == [(0,)] and prepared(pg, sink.sink_id) == []


def test_two_phase_needs_prepared_transactions(spark, pg_noprepared):
    schema = stream_schema(spark)
    with pytest.raises(ConfigError, match="max_prepared_transactions.*idempotent"):
        PostgresSink(pg_noprepared.dsn, table="t", create_table=True).data_source().validate(schema, False)
    PostgresSink(pg_noprepared.dsn, table=f"t_{uid()}", mode="idempotent", create_table=True).data_source().validate(schema, False)


def test_password_is_masked_everywhere(pg):
    sink = PostgresSink(pg.dsn, table="t")
    assert pg.password not in repr(sink) and pg.password not in str(sink) and "***" in repr(sink)
    opts = sink.options()
    assert pg.password not in opts["dsn"] and opts["password"] == pg.password  # Spark redacts *password* keys
    source = sink.data_source()
    assert pg.password not in repr(source)
    kv = PostgresSink(f"host=127.0.0.1 port={pg.port} user=postgres password={pg.password}", table="t")
    assert pg.password not in repr(kv)
    # malformed DSNs: libpq's parse errors quote fragments of the string
    for bad in (f"host=h password=se {pg.password}", f"host=h password='{pg.password}",
                f"postgresql://u:{pg.password} x@h/db x"):
        with pytest.raises(ConfigError, match="cannot parse the DSN") as e:
            PostgresSink(bad, table="t").options()
        assert pg.password not in str(e.value)


# ---- doctor -----------------------------------------------------------------------------------


class Database:
    """A fresh database on a shared cluster (doctor and resolve look at a whole database)."""

    def __init__(self, cluster, name: str):
        execute(cluster, f"CREATE DATABASE {name}")
        self.dsn, self.password, self.port = cluster.dsn.rsplit("/", 1)[0] + f"/{name}", cluster.password, cluster.port


def test_doctor_reports_and_resolve_applies_recovery_rules(spark, pg, pg_noprepared, tmp_path):
    from onceflow.sinks.postgres.doctor import doctor, resolve

    db = Database(pg, f"doctor_{uid()}")
    decided_sink = make_sink(db)
    assert "InjectedCrash" in run_stream(spark, tmp_path, decided_sink, crash="after_decide@1:raise")
    # a driver killed before its decision: two undecided prepared transactions
    undecided_table = f"t_{uid()}"
    execute(db, f"CREATE TABLE {undecided_table} (id bigint)")
    dead_lineage = uuid.uuid4()
    for p in range(2):
        with psycopg.connect(db.dsn, autocommit=True) as conn:
            conn.execute("BEGIN")
            conn.execute(f"INSERT INTO {undecided_table} VALUES ({p})")
            conn.execute(f"PREPARE TRANSACTION 'onceflow:dead:{dead_lineage}:1:{p}:0:run'")
    checks = {c.name: c for c in doctor(db.dsn)}
    assert checks["reachable"].ok and checks["max_prepared_transactions"].ok and checks["create_privilege"].ok
    dangling = checks["dangling_prepared_transactions"]
    assert not dangling.ok and "2 decided (to commit)" in dangling.detail and "2 undecided (to roll back)" in dangling.detail
    assert "exactly-once" in checks["guarantees"].detail and "(idempotent upsert)" in checks["guarantees"].detail
    assert "at least the write partitions of all two_phase" in checks["max_prepared_transactions"].detail
    report = resolve(db.dsn)
    assert (report.committed, report.rolled_back, report.skipped) == (2, 2, [])
    assert rows(db, f"SELECT count(*) FROM {decided_sink.table}") == [(1000,)]
    assert rows(db, f"SELECT count(*) FROM {undecided_table}") == [(0,)]
    assert {c.name: c.ok for c in doctor(db.dsn)}["dangling_prepared_transactions"]
    assert not {c.name: c.ok for c in doctor(pg_noprepared.dsn)}["max_prepared_transactions"]
    unreachable = doctor(f"postgresql://postgres:{pg.password}@127.0.0.1:1/postgres")
    assert [c.ok for c in unreachable] == [False] and pg.password not in unreachable[0].detail


def test_doctor_cli_lists_a_dangling_transaction_and_resolve_clears_it(pg):
    from click.testing import CliRunner

    from onceflow.cli.doctor import doctor

    db = Database(pg, f"cli_{uid()}")
    execute(db, "CREATE TABLE t (id bigint)")
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        conn.execute("BEGIN")
        conn.execute("INSERT INTO t VALUES (1)")
        conn.execute(f"PREPARE TRANSACTION 'onceflow:cli:{uuid.uuid4()}:0:0:0:run'")
    runner = CliRunner()
    listed = runner.invoke(doctor, ["--postgres", db.dsn])
    assert listed.exit_code == 1, listed.output
    assert "1 onceflow prepared transaction(s)" in listed.output and "1 undecided (to roll back)" in listed.output
    resolved = runner.invoke(doctor, ["--postgres", db.dsn, "--resolve"])
    assert resolved.exit_code == 0, resolved.output
    assert "committed 0, rolled back 1" in resolved.output
    assert "dangling_prepared_transactions after resolve: none" in resolved.output
    assert pg.password not in listed.output + resolved.output
    assert rows(db, "SELECT count(*) FROM t") == [(0,)]
    assert runner.invoke(doctor, ["--postgres", db.dsn]).exit_code == 0
    listing = runner.invoke(doctor, [])
    assert "mode=idempotent write=upsert: exactly-once effect (idempotent upsert)" in listing.output
    bad = runner.invoke(doctor, ["--postgres", f"host=h password='{pg.password}"])
    assert bad.exit_code == 1 and "cannot parse the DSN" in bad.output and pg.password not in bad.output


def test_resolve_leaves_a_connected_drivers_transactions_alone(pg):
    """A lineage with a connected driver is not fenced by resolve: its current epoch's undecided
    transaction stays (reported as skipped) while those of a superseded epoch are rolled back;
    once the driver is gone, resolve takes a new epoch and rolls back the rest."""
    from onceflow.sinks.postgres.doctor import resolve

    db = Database(pg, f"resolve_{uid()}")
    sink = make_sink(db)
    lineage = str(uuid.uuid4())
    driver = sink.data_source()
    epoch = driver.open(lineage)  # the running driver (its idle connection stays); batch 0 in flight
    assert epoch == 1
    for gid in (f"onceflow:{sink.sink_id}:{lineage}:0:0:0:e{epoch}:run", f"onceflow:{sink.sink_id}:{lineage}:0:0:0:old"):
        with psycopg.connect(db.dsn, autocommit=True) as conn:
            conn.execute("BEGIN")
            conn.execute(f"PREPARE TRANSACTION '{gid}'")
    report = resolve(db.dsn)
    assert (report.committed, report.rolled_back, report.ok) == (0, 1, False)
    assert "1 undecided prepared transaction(s) of the current epoch left to its driver" in report.skipped[0]
    assert prepared(db, sink.sink_id) == [f"onceflow:{sink.sink_id}:{lineage}:0:0:0:e{epoch}:run"]
    driver.close()  # the driver stops
    deadline = time.monotonic() + 10
    while rows(db, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                   "AND starts_with(application_name, 'of:')")[0][0]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    report = resolve(db.dsn)
    assert (report.rolled_back, report.skipped) == (1, [])
    assert prepared(db, sink.sink_id) == []
    assert rows(db, "SELECT epoch FROM onceflow_epochs WHERE sink = %s", sink.sink_id) == [(2,)]


# ---- epoch fencing (sink level, no Spark) -------------------------------------------------------


def _kv():
    from pyspark.sql import types as T

    return T.StructType([T.StructField("id", T.LongType())])


def write_task(source, lineage: str, batch: int, ids, partition: int = 0, attempt: int = 0):
    """A task's pre-commit without Spark; returns its handle."""
    import pyarrow as pa

    from onceflow.sinks.base import TaskInfo

    def batches():
        yield pa.RecordBatch.from_arrays([pa.array(list(ids), pa.int64())], names=["id"])

    handle, _ = source.pre_commit(TaskInfo(lineage, batch, partition, attempt), _kv(), False, batches())
    return handle


def opened(sink, lineage: str):
    """(driver data source after validate + open, its epoch, a task data source with that epoch)."""
    driver = sink.data_source()
    driver.validate(_kv(), False)
    epoch = driver.open(lineage)
    return driver, epoch, sink.data_source({"epoch": str(epoch)})


def test_rival_decision_is_refused_and_the_callers_transactions_stay_uncommitted(pg):
    """decide() of a different decision for an already decided (lineage, batch) raises
    FencedError naming both and records nothing; the caller's prepared gid is not committed.
    A retry of the recorded decision itself is accepted.
    Old code: INSERT ... ON CONFLICT DO NOTHING accepted the rival silently (no error), after
    which the base writer COMMIT PREPAREd the caller's own gids."""
    sink = make_sink(pg)
    lineage = str(uuid.uuid4())
    a, ea, a_task = opened(sink, lineage)
    h1 = write_task(a_task, lineage, 1, range(10))
    h2 = write_task(a_task, lineage, 1, range(100, 110), partition=1)
    a.decide(Decision(lineage, 1, "fp-a", [h1], ea), _kv(), False)
    with pytest.raises(FencedError, match="is already decided") as e:
        a.decide(Decision(lineage, 1, "fp-b", [h2], ea), _kv(), False)
    assert f"(epoch {ea}, fingerprint fp-a, 1 handle(s)); this driver proposed a different decision" in str(e.value)
    assert f"(epoch {ea}, fingerprint fp-b, 1 handle(s))" in str(e.value)
    assert a.decision(lineage, 1) == Decision(lineage, 1, "fp-a", [h1], ea)
    assert prepared(pg, sink.sink_id) == sorted([h1["gid"], h2["gid"]])  # decide committed nothing
    a.decide(Decision(lineage, 1, "fp-a", [h1], ea), _kv(), False)  # a retry of the recorded decision
    b, eb, _ = opened(sink, lineage)  # rolls A's decided gid forward, its undecided one back
    assert b.recovered == {"committed": 1, "rolled_back": 1}
    with pytest.raises(FencedError, match=f"already decided \\(epoch {ea}, fingerprint fp-a"):
        b.decide(Decision(lineage, 1, "fp-a", [], eb), _kv(), False)  # same offsets, another epoch
    assert sorted(r[0] for r in rows(pg, f"SELECT id FROM {sink.table}")) == list(range(10))
    assert prepared(pg, sink.sink_id) == []


@pytest.mark.parametrize("mode", ["two_phase", "idempotent"])
def test_zombie_driver_is_fenced_and_nothing_of_it_becomes_visible(pg, pg_noprepared, mode):
    """Driver A opens (epoch e) and its task pre-commits batch 1; A pauses. Driver B opens
    (e + 1): A's undecided transaction is rolled back. A wakes up: its next task is refused
    before writing, its decide and its abort are refused and change nothing, and B's transactions
    are untouched; B's batch is the only one visible.
    Old code: B's open() raised FencedError (A's advisory lock; a paused A keeps it forever), and
    a zombie's task rolled back every prepared transaction of another Spark run id."""
    server = server_for(mode, pg, pg_noprepared)
    sink = make_sink(server, mode)
    lineage = str(uuid.uuid4())
    a, ea, a_task = opened(sink, lineage)
    a_handle = write_task(a_task, lineage, 1, range(10))
    b, eb, b_task = opened(sink, lineage)
    assert eb == ea + 1
    if mode == "two_phase":
        assert b.recovered == {"committed": 0, "rolled_back": 1} and prepared(server, sink.sink_id) == []
    # B's replay of batch 1 reads the same input as A's attempt (two_phase: A's attempt was
    # rolled back, so other rows show which attempt is visible; idempotent: the replay skips
    # A's committed partition only because it reads the same rows).
    b_handle = write_task(b_task, lineage, 1, range(100, 110) if mode == "two_phase" else range(10))
    # A wakes up
    with pytest.raises(FencedError, match=f"write refused: this driver holds epoch {ea} of lineage {lineage}, but epoch {eb}"):
        write_task(a_task, lineage, 2, range(10, 20))
    with pytest.raises(FencedError, match=f"decide refused: this driver holds epoch {ea}"):
        a.decide(Decision(lineage, 1, "fp", [a_handle], ea), _kv(), False)
    if mode == "two_phase":
        with pytest.raises(FencedError, match="abort refused"):
            a.abort(lineage, 1, [b_handle])
        assert prepared(server, sink.sink_id) == [b_handle["gid"]]
    assert a.decision(lineage, 1) is None
    b.decide(Decision(lineage, 1, "fp", [b_handle], eb), _kv(), False)
    b.commit(b.decision(lineage, 1))
    visible = sorted(r[0] for r in rows(server, f"SELECT id FROM {sink.table}"))
    # idempotent: A's task committed its partition before B opened (that is its weaker
    # visibility: a batch's committed partitions stay and the replay skips them)
    assert visible == (list(range(100, 110)) if mode == "two_phase" else list(range(10)))
    assert prepared(server, sink.sink_id) == []


def test_two_phase_task_leaves_no_prepared_transaction_once_its_epoch_is_superseded(pg):
    """A zombie's task that connected after its successor's takeover (so the takeover's
    termination of old-epoch sessions missed it) PREPAREs after the successor's recovery ran:
    no decision will list that gid. The task rolls it back itself and is fenced.
    Old code: the prepared transaction stayed until a later task of the successor cleaned it
    (forever, if the successor had finished)."""
    sink = make_sink(pg, "two_phase")
    lineage = str(uuid.uuid4())
    _, epoch, task = opened(sink, lineage)

    def batches():
        import pyarrow as pa

        yield pa.RecordBatch.from_arrays([pa.array(range(10), pa.int64())], names=["id"])
        execute(pg, f"UPDATE onceflow_epochs SET epoch = epoch + 1 WHERE lineage = '{lineage}'")
        yield pa.RecordBatch.from_arrays([pa.array(range(10, 20), pa.int64())], names=["id"])

    from onceflow.sinks.base import TaskInfo

    with pytest.raises(FencedError, match=f"write refused: this driver holds epoch {epoch}"):
        task.pre_commit(TaskInfo(lineage, 1, 0, 0), _kv(), False, batches())
    assert prepared(pg, sink.sink_id) == []
    assert rows(pg, f"SELECT count(*) FROM {sink.table}") == [(0,)]


def test_idempotent_task_commits_nothing_once_its_epoch_is_superseded(pg_noprepared):
    """An idempotent task's transaction makes its rows visible, so it re-reads the epoch FOR
    SHARE in that transaction: a successor opening while the task writes makes it roll back
    rows and marker. Old code: no check, the rows were committed."""
    sink = make_sink(pg_noprepared, "idempotent")
    lineage = str(uuid.uuid4())
    _, epoch, task = opened(sink, lineage)

    def batches():
        import pyarrow as pa

        yield pa.RecordBatch.from_arrays([pa.array(range(10), pa.int64())], names=["id"])
        execute(pg_noprepared, f"UPDATE onceflow_epochs SET epoch = epoch + 1 WHERE lineage = '{lineage}'")
        yield pa.RecordBatch.from_arrays([pa.array(range(10, 20), pa.int64())], names=["id"])

    from onceflow.sinks.base import TaskInfo

    with pytest.raises(FencedError, match=f"write refused: this driver holds epoch {epoch}"):
        task.pre_commit(TaskInfo(lineage, 1, 0, 0), _kv(), False, batches())
    assert rows(pg_noprepared, f"SELECT count(*) FROM {sink.table}") == [(0,)]
    assert rows(pg_noprepared, "SELECT count(*) FROM onceflow_markers WHERE sink = %s", sink.sink_id) == [(0,)]


PAUSED_DRIVER = """
import os, signal, sys
import psycopg
from onceflow.sinks.postgres import PostgresSink
from onceflow.sinks.postgres.fence import advisory_key, app_name

dsn, table, sid, lineage = sys.argv[1:]
source = PostgresSink(dsn, table, create_table=True, sink_id=sid).data_source()
epoch = source.open(lineage)
# a decide in progress: the lineage's decide lock and the epoch row FOR SHARE
conn = psycopg.connect(dsn, autocommit=True, application_name=app_name(sid, lineage, epoch, "driver"))
conn.execute("BEGIN")
conn.execute("SELECT pg_advisory_xact_lock(%s)", [advisory_key("onceflow-decide", sid, lineage)])
conn.execute("SELECT epoch FROM onceflow_epochs WHERE sink = %s AND lineage = %s FOR SHARE", [sid, lineage])
print(epoch, flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


@pytest.mark.timeout(90)
def test_a_paused_drivers_locks_do_not_block_the_successor(pg, tmp_path):
    """A SIGSTOPped driver keeps its TCP connections, so PostgreSQL keeps its sessions, open
    transactions and locks (here: idle in transaction, holding the decide lock and the epoch row
    FOR SHARE). The successor's open() terminates them (identified by application_name) instead
    of waiting, and can decide and commit.
    Old code: the paused driver's session advisory lock made every later open() raise
    FencedError ('another driver is running') for as long as the process stayed paused."""
    import subprocess
    import sys

    sink = make_sink(pg)
    lineage = str(uuid.uuid4())
    sink.data_source().validate(_kv(), False)
    (tmp_path / "paused.py").write_text(PAUSED_DRIVER)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "paused.py"), pg.dsn, sink.table, sink.sink_id, lineage],
                            stdout=subprocess.PIPE, text=True)
    try:
        ea = int(proc.stdout.readline())
        deadline = time.monotonic() + 20
        while rows(pg, "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' "
                       "AND starts_with(application_name, 'of:')")[0][0] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        started = time.monotonic()
        b, eb, b_task = opened(sink, lineage)
        took = time.monotonic() - started
        assert eb == ea + 1 and took < 10, took
        handle = write_task(b_task, lineage, 1, range(5))
        b.decide(Decision(lineage, 1, "fp", [handle], eb), _kv(), False)
        b.commit(b.decision(lineage, 1))
        assert rows(pg, f"SELECT count(*) FROM {sink.table}") == [(5,)]
        assert rows(pg, "SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid() "
                        "AND state = 'idle in transaction'") == [(0,)]
    finally:
        proc.kill()
        proc.wait()


def test_unreachable_server_is_a_sink_error_in_every_step(pg, caplog):
    """open (epoch), recovery, decision look-up, decide and commit of an unreachable server raise
    a one-line SinkError naming host:port, never ConfigError and never the password; every retry
    before it logged one line saying what waits and why (before: retries were silent, and a
    verify run through a network partition left no trace of it in the job's log)."""
    dead = PostgresSink(f"postgresql://postgres:{pg.password}@127.0.0.1:1/postgres", table="t", commit_deadline=0.5)
    source = dead.data_source({"epoch": "3"})
    lineage = str(uuid.uuid4())
    steps = {
        "open": lambda: source.open(lineage),
        "recovery": lambda: source.recover(lineage),
        "decision lookup": lambda: source.decision(lineage, 1),
        "decide": lambda: source.decide(Decision(lineage, 1, "fp", [], 3), _kv(), False),
        "commit": lambda: source.commit(Decision(lineage, 1, "fp", [{"gid": "g", "xid": 1}], 3)),
    }
    for purpose, step in steps.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="onceflow.sinks.postgres"), pytest.raises(SinkError) as e:
            step()
        msg = str(e.value)
        assert f"{purpose} failed: PostgreSQL at 127.0.0.1:1/postgres unreachable" in msg, msg
        assert "\n" not in msg and pg.password not in msg
        retries = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
        assert retries and all(f"{purpose} at 127.0.0.1:1/postgres failed (" in m and "Connection refused" in m
                               and "\n" not in m and pg.password not in m for m in retries), caplog.text


# ---- upsert constraints and the staging table ---------------------------------------------------


def test_upsert_constraint_violation_fails_its_task_and_a_merge_failure_is_one_line(spark, pg, tmp_path):
    """NOT NULL / CHECK are repeated on the staging table: a NULL into a NOT NULL column fails
    its task before any decision (nothing decided, committed or left prepared). A foreign key is
    only checked by the merge: it fails with a one-line error, the batch stays staged, and once
    the parent rows exist recovery (here: doctor's resolve) merges it."""
    from onceflow.sinks.postgres.doctor import resolve

    db = Database(pg, f"constraints_{uid()}")
    sink = make_sink(db, write="upsert", keys=["k"])
    execute(db, f"CREATE TABLE {sink.table} (k bigint PRIMARY KEY, v bigint NOT NULL CHECK (v >= 0), label text)")
    err = run_stream(spark, tmp_path / "a", sink, total=1000, per_batch=1000, timeout=60, transform=lambda df: df.selectExpr(
        "id % 100 AS k", "CASE WHEN id = 500 THEN NULL ELSE id END AS v", "concat('v', id) AS label"))
    assert err and f"a row of batch 1 violates a constraint of table {sink.table}: null value in column \"v\"" in err
    assert "nothing of this batch was committed or decided" in err
    assert rows(db, "SELECT count(*) FROM onceflow_commit_log WHERE sink = %s AND batch_id > 0", sink.sink_id) == [(0,)]
    stage = sink.data_source().stage_table.as_string()
    assert rows(db, f"SELECT count(*) FROM {stage}") == [(0,)] and rows(db, f"SELECT count(*) FROM {sink.table}") == [(0,)]
    assert prepared(db, sink.sink_id) == []

    execute(db, "CREATE TABLE parent (id bigint PRIMARY KEY)")
    child = make_sink(db, write="upsert", keys=["k"])
    execute(db, f"CREATE TABLE {child.table} (k bigint PRIMARY KEY, p bigint REFERENCES parent (id))")
    err = run_stream(spark, tmp_path / "b", child, total=1000, per_batch=1000, timeout=60,
                     transform=lambda df: df.selectExpr("id % 100 AS k", "id AS p"))
    line = next((x for x in (err or "").splitlines() if "merging decided batch 1 of lineage" in x), "")
    assert f'into table "{child.table}" failed' in line and "violates foreign key constraint" in line
    assert "onceflow doctor --postgres DSN --resolve" in line
    assert prepared(db, child.sink_id) == [] and rows(db, f"SELECT count(*) FROM {child.table}") == [(0,)]
    execute(db, "INSERT INTO parent SELECT generate_series(0, 999)")
    report = resolve(db.dsn)
    assert (report.merged, report.skipped) == (1, [])
    assert rows(db, f"SELECT count(*), min(p), max(p) FROM {child.table}") == [(100, 900, 999)]


@pytest.mark.timeout(90)
def test_staging_table_is_not_dropped_under_prepared_rows_and_decision_needs_no_commit_log(pg):
    """Rows in prepared transactions are invisible to count(*): the staging table must not be
    dropped (DROP would block on them, or drop a decided batch). And a decision look-up on a
    database without onceflow's tables answers None (``run --from-savepoint`` pre-checks)."""
    from pyspark.sql import types as T

    db = Database(pg, f"stage_{uid()}")
    sink = make_sink(db, write="upsert", keys=["k"])
    assert sink.data_source().decision(str(uuid.uuid4()), 3) is None
    execute(db, f"CREATE TABLE {sink.table} (k bigint PRIMARY KEY, v bigint NOT NULL CHECK (v > 0), label text)")
    kv = T.StructType([T.StructField("k", T.LongType()), T.StructField("v", T.LongType())])
    kvl = T.StructType([*kv.fields, T.StructField("label", T.StringType())])
    source = sink.data_source()
    source.validate(kv, False)
    stage = source.stage_table.as_string()
    with psycopg.connect(db.dsn, autocommit=True) as conn:  # the staging table repeats NOT NULL and CHECK
        for bad in ("NULL", "0"):
            with pytest.raises(psycopg.errors.IntegrityError):
                conn.execute(f"INSERT INTO {stage} (_onceflow_lineage, _onceflow_batch, k, v) VALUES ('l', 1, 1, {bad})")
        gid = f"onceflow:{sink.sink_id}:{uuid.uuid4()}:1:0:0:run"
        conn.execute("BEGIN")
        conn.execute(f"INSERT INTO {stage} (_onceflow_lineage, _onceflow_batch, k, v) VALUES ('l', 1, 1, 1)")
        conn.execute(f"PREPARE TRANSACTION '{gid}'")
    try:
        started = time.monotonic()
        with pytest.raises(ConfigError, match=r"holds an unfinished batch \(1 prepared transaction\(s\) of sink .*--resolve"):
            sink.data_source().validate(kvl, False)
        assert time.monotonic() - started < 10
    finally:
        execute(db, f"ROLLBACK PREPARED '{gid}'")
    sink.data_source().validate(kvl, False)  # nothing pending: recreated with the new columns
    assert [c for (c,) in rows(db, "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 4 "
                                   "ORDER BY attnum", stage)] == ["k", "v", "label"]


# ---- lock timeout: a zombie's prepared rows ------------------------------------------------------


def _zombie_prepares(pg, table: str, gid: str, ids) -> None:
    """What a task leaves when it PREPAREs and dies before its epoch re-check: a prepared
    transaction under its gid holding the rows (and their unique-index entries) it inserted."""
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        conn.execute("BEGIN")
        conn.execute(f"INSERT INTO {table} (id) SELECT generate_series(%s::bigint, %s::bigint)", [ids[0], ids[-1]])
        conn.execute(f"PREPARE TRANSACTION '{gid}'")


def _task_within(pg, source, lineage: str, ids, attempt: int, seconds: float, before_rows=None) -> dict:
    """Run a task's pre-commit of batch 1 partition 0 in a thread (``before_rows`` runs when the
    task starts consuming its rows: after its start-up clean-up, inside its transaction);
    return {"handle": ...} or {"error": ...}, or fail when it is still blocked after
    ``seconds`` (its PostgreSQL backend is then cancelled)."""
    import threading

    import pyarrow as pa

    from onceflow.sinks.base import TaskInfo

    out: dict = {}

    def batches():
        if before_rows:
            before_rows()
        yield pa.RecordBatch.from_arrays([pa.array(list(ids), pa.int64())], names=["id"])

    def run() -> None:
        try:
            out["handle"], _ = source.pre_commit(TaskInfo(lineage, 1, 0, attempt), _kv(), False, batches())
        except Exception as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        waiting = rows(pg, "SELECT pid, wait_event_type, wait_event, left(query, 60) FROM pg_stat_activity "
                           "WHERE wait_event_type = 'Lock'")
        for pid, *_ in waiting:
            rows(pg, "SELECT pg_cancel_backend(%s)", pid)
        t.join(10)
        raise AssertionError(f"the task was still blocked after {seconds:g}s: {waiting}")
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("zombie", ["older_epoch", "other_attempt"])
def test_task_blocked_by_a_zombies_prepared_rows_fails_retries_and_proceeds_exactly_once(pg, zombie):
    """The table has a primary key. ``older_epoch``: driver B took over from A (epoch + 1, its
    recovery ran); B's task started (its clean-up of stale transactions ran); then A's task
    PREPAREd rows with ids 0..9 and died before its epoch re-check. ``other_attempt``: the
    same from an earlier attempt of B's own task (a lost executor that still reached
    PostgreSQL). B's task inserts the same ids: its transaction waits for the prepared one.
    With a lock timeout (default 10 s; 2 s set as the option in the second case) the task fails
    with a SinkError naming the zombie's gid; Spark's retry of the task rolls the zombie back
    and writes; the batch commits ids 0..9 exactly once.
    Old code: no lock timeout, the task waited forever (still blocked after 60 s here), and
    the retry that would roll the zombie back never came."""
    kw = {} if zombie == "older_epoch" else {"lock_timeout": 2}
    sink = make_sink(pg, **kw)
    execute(pg, f"CREATE TABLE {sink.table} (id bigint PRIMARY KEY)")
    lineage = str(uuid.uuid4())
    _, ea, _ = opened(sink, lineage)
    b, eb, b_task = opened(sink, lineage)
    assert eb == ea + 1
    gid = (f"onceflow:{sink.sink_id}:{lineage}:1:0:0:e{ea}:zombie-run" if zombie == "older_epoch"
           else f"onceflow:{sink.sink_id}:{lineage}:1:0:0:e{eb}:unknown")
    first = 0 if zombie == "older_epoch" else 1
    started = time.monotonic()
    out = _task_within(pg, b_task, lineage, range(10), first, 60,
                       before_rows=lambda: _zombie_prepares(pg, sink.table, gid, range(10)))
    took = time.monotonic() - started
    error = out.get("error")
    assert isinstance(error, SinkError), out
    msg = str(error)
    wait = 10 if zombie == "older_epoch" else 2
    assert f"task of batch 1 partition 0 (attempt {first}) waited {wait}s for a lock on" in msg, msg
    assert f"prepared transaction(s) {gid} hold locks on it" in msg and "the task is retried" in msg, msg
    assert "\n" not in msg and pg.password not in msg
    assert took >= wait, took  # it did wait for the zombie, lock_timeout long
    assert prepared(pg, sink.sink_id) == [gid]  # the failed attempt left nothing of its own

    handle = _task_within(pg, b_task, lineage, range(10), first + 1, 60)["handle"]  # Spark's retry
    assert prepared(pg, sink.sink_id) == [handle["gid"]]  # the zombie's gid was rolled back
    b.decide(Decision(lineage, 1, "fp", [handle], eb), _kv(), False)
    b.commit(b.decision(lineage, 1))
    assert_exactly_once(pg, sink.table, 10, sink.sink_id)


def test_lock_timeout_option_is_checked(pg):
    for bad in ("0", "-1", "soon"):
        with pytest.raises(ConfigError, match="lock_timeout"):
            make_sink(pg, lock_timeout=bad).data_source()
