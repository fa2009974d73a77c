"""RestoreContext: what a job's source and transform learn about how their run started."""

from __future__ import annotations

import functools

import pytest
from test_runner import CrashingDeltaSink, seq

from onceflow.checkpoint.layout import CheckpointDir
from onceflow.errors import ConfigError
from onceflow.job import CheckpointConfig, Job
from onceflow.runtime.restart import fixed_delay
from onceflow.savepoint.context import RestoreContext, call
from onceflow.sinks.delta import DeltaSink
from onceflow.verify.exactly_once import check_delta_table


def test_fresh_then_restarted_in_process_then_resumed(spark, tmp_path):
    """First query: fresh, attempt 0. A failed batch restarts the query in the same driver:
    resumed, attempt 1, the checkpoint's lineage. A later run of the same checkpoint: resumed,
    attempt 0. The transform gets the same context as the source."""
    (tmp_path / "m").mkdir()
    seen: list[tuple[str, RestoreContext]] = []

    def source(spark, ctx):
        seen.append(("source", ctx))
        return seq(total, 1000)(spark)

    def transform(df, ctx):
        seen.append(("transform", ctx))
        return df

    def job(sink):
        return Job(name="ctx", source=source, transform=transform, sink=sink,
                   checkpoint=CheckpointConfig(str(tmp_path / "ckpt"), interval=0),
                   restart_strategy=fixed_delay(attempts=2, delay=0), stop_when_idle=0.5)

    total = 3000
    job(CrashingDeltaSink(str(tmp_path / "t"), "after_commit@1:raise", str(tmp_path / "m"))).run(spark=spark)
    total = 5000
    job(DeltaSink(str(tmp_path / "t"))).run(spark=spark)
    assert check_delta_table(str(tmp_path / "t"), 5000).ok

    lineage = CheckpointDir(str(tmp_path / "ckpt")).lineage
    sources = [c for who, c in seen if who == "source"]
    assert [c for who, c in seen if who == "transform"] == sources
    assert [(c.start, c.attempt, c.is_restored) for c in sources] == [
        ("fresh", 0, False), ("resumed", 1, True), ("resumed", 0, True)]
    assert sources[0].lineage is None and sources[1].lineage == sources[2].lineage == lineage
    assert not any(c.from_savepoint or c.forked for c in sources)


def test_one_argument_functions_are_called_as_before():
    ctx = RestoreContext("resumed", attempt=2)
    assert call(lambda spark: spark, "s", ctx) == "s"
    assert call(lambda spark, topic="t": (spark, topic), "s", ctx) == ("s", "t")  # a default stays
    assert call(lambda spark, ctx: (spark, ctx.attempt), "s", ctx) == ("s", 2)
    assert call(functools.partial(lambda a, spark, ctx: ctx.start, 1), "s", ctx) == "resumed"
    assert call(lambda *args: len(args), "s", ctx) == 2


@pytest.mark.parametrize("field, fn, msg", [
    ("source", lambda spark, ctx, extra: None, "Job.source takes 3 required arguments"),
    ("transform", lambda: None, "Job.transform takes no argument"),
])
def test_a_function_of_the_wrong_shape_is_refused(tmp_path, field, fn, msg):
    kwargs = {"source": lambda spark: None, field: fn}
    with pytest.raises(ConfigError, match=msg):
        Job(name="bad", sink=DeltaSink(str(tmp_path / "t")),
            checkpoint=CheckpointConfig(str(tmp_path / "c")), **kwargs)


def test_driver_restarts_are_counted_from_the_supervisors_event_log(tmp_path):
    """``onceflow run`` logs each driver process it starts (with its attempt number): the
    runner of that process reports attempt - 1; other processes' entries do not count."""
    import os

    from onceflow.checkpoint.eventlog import EventLog
    from onceflow.runtime.runner import JobRunner

    ckpt = str(tmp_path / "ckpt")
    log = EventLog(ckpt)
    log.append("process_start", attempt=1, pid=os.getpid() + 1)
    log.append("process_start", attempt=3)  # this process, third driver of the run
    log.append("process_start", attempt=4, pid=os.getpid() + 2)
    job = Job(name="a", source=lambda spark: None, sink=DeltaSink(str(tmp_path / "t")),
              checkpoint=CheckpointConfig(ckpt))
    runner = JobRunner(job)
    assert runner._process_attempt() == 2
    assert runner.context() == RestoreContext("fresh", attempt=0)  # before run(): nothing planned
