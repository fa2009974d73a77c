"""Restoring or forking a savepoint whose next batch is partly visible (issue 28 point 2).

PostgreSQL ``idempotent`` append: each task commits its rows and a marker on its own, so a job
that dies between its tasks and its decision leaves batch N visible under its lineage without
a decision. A fork from a savepoint at batch N-1 replays all of batch N under a new lineage:
restore must call that a roll back and say loudly which sink, lineage, batch, partitions and
how many rows stay visible (and would be written again). Resuming the same lineage instead
completes batch N without a duplicate. Real Spark (local), real PostgreSQL, no mocks.
"""

from __future__ import annotations

import json
import logging
import uuid

import psycopg
import pytest

from onceflow.checkpoint.layout import CheckpointDir
from onceflow.errors import OnceflowError
from onceflow.job import CheckpointConfig, Job
from onceflow.runtime.restart import no_restart
from onceflow.savepoint import RestoreRequest, create_savepoint
from onceflow.sinks.postgres import PostgresSink

PER_BATCH = 1000


def job(ckpt, pg, table: str, sink_id: str, total: int, crash: dict[str, str] | None = None) -> Job:
    sink = PostgresSink(pg.dsn, table, mode="idempotent", create_table=True, sink_id=sink_id,
                        commit_deadline=20)
    if crash:
        opts = sink.options() | crash
        sink.options = lambda: opts  # type: ignore[method-assign]

    def source(spark):
        return (spark.readStream.format("onceflow-sequence").option("total", total)
                .option("rows_per_second", 10**9).option("max_rows_per_batch", PER_BATCH)
                .option("partitions", 3).load())

    return Job(name="partly-visible", source=source, transform=lambda df: df.select("id"), sink=sink,
               checkpoint=CheckpointConfig(str(ckpt), interval=0), restart_strategy=no_restart(),
               stop_when_idle=0.5)


def ids(pg, table: str) -> tuple[int, int]:
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        return conn.execute(f"SELECT count(*), count(DISTINCT id) FROM {table}").fetchone()


@pytest.mark.timeout(120)
def test_fork_before_a_partly_visible_batch_is_a_loud_roll_back_and_resume_completes_it(
        spark, sp_pg, tmp_path, caplog):
    table, sink_id = f"pv_{uuid.uuid4().hex[:8]}", f"pv{uuid.uuid4().hex[:6]}"
    ckpt = tmp_path / "ckpt"
    job(ckpt, sp_pg, table, sink_id, 2 * PER_BATCH).run(spark=spark)
    sp, manifest = create_savepoint(str(ckpt), str(tmp_path / "sp1"))
    lineage = CheckpointDir(str(ckpt)).lineage
    n = manifest.batch + 1
    # Batch n: every task commits its partition, the driver dies before deciding.
    (tmp_path / "markers").mkdir()
    crash = {"test_crash_at": f"before_decide@{n}:raise", "test_crash_markers": str(tmp_path / "markers")}
    with pytest.raises(OnceflowError, match="gave up"):
        job(ckpt, sp_pg, table, sink_id, 3 * PER_BATCH, crash).run(spark=spark)
    assert [m.name.split("-")[1] for m in (tmp_path / "markers").iterdir()] == ["before_decide"]
    assert ids(sp_pg, table) == (3 * PER_BATCH, 3 * PER_BATCH)  # batch n visible, undecided

    later = job(tmp_path / "unused", sp_pg, table, sink_id, 3 * PER_BATCH)
    with caplog.at_level(logging.WARNING, logger="onceflow.savepoint"):
        forked = RestoreRequest(sp, fork=True).apply(str(tmp_path / "fork"), job=later, spark=spark)
    assert forked.mode == "rollback"
    assert forked.partly_visible is not None and sorted(forked.partly_visible.partitions) == [0, 1, 2]
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert warning.startswith("ROLL BACK"), warning
    for part in (sink_id, f"partition(s) 0, 1, 2 of batch {n} of lineage {lineage} (1000 rows)",
                 "STAY VISIBLE", f"NEW lineage {forked.lineage}", "up to 1000 rows are DUPLICATED"):
        assert part in warning, warning
    events = [json.loads(x) for x in open(tmp_path / "fork" / "_onceflow" / "events.jsonl")]
    restore = next(e for e in events if e["event"] == "restore")
    assert restore["mode"] == "rollback" and restore["partly_visible"]["partitions"] == [0, 1, 2]

    # The way that cannot duplicate: resume the same lineage; its replay skips the partitions.
    caplog.clear()
    resumed = tmp_path / "resumed"
    with caplog.at_level(logging.WARNING, logger="onceflow.savepoint"):
        job(resumed, sp_pg, table, sink_id, 4 * PER_BATCH).run(spark=spark, from_savepoint=sp)
    assert CheckpointDir(str(resumed)).lineage == lineage
    assert any("skips each of them" in r.getMessage() for r in caplog.records), caplog.text
    assert ids(sp_pg, table) == (4 * PER_BATCH, 4 * PER_BATCH)
