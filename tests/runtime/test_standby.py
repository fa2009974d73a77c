"""The standby's go file: what the supervisor tells a promoted standby about the lease."""

from __future__ import annotations

from onceflow.runtime.standby import promote, takes_over
from onceflow.verify.procs import DAEMONS


def test_the_go_file_names_the_epoch_to_take_over_or_none(tmp_path):
    go = str(tmp_path / "go-1")
    promote(go, 7)
    assert takes_over(go) == 7 and takes_over(go) is not True
    promote(go, None)
    assert takes_over(go) is False
    (tmp_path / "go-2").write_text("")  # an empty go file (tests, older supervisors): any holder
    assert takes_over(str(tmp_path / "go-2")) is True
    (tmp_path / "go-3").write_text("at=1.0 takeover=1\n")  # the format before holder=
    assert takes_over(str(tmp_path / "go-3")) is True


def test_a_standby_builds_the_jobs_dataframe_ahead_and_a_source_it_cannot_build_costs_only_warmth(
        spark, tmp_path, caplog):
    """:func:`plan_job` (the standby's warm-up): the job's source and transform are called and
    the plan analysed, with a context like the takeover's, and nothing starts; a source that
    fails now (a broker down) is logged, not raised: the takeover builds it as before. Old code:
    no ``plan_job``, the promoted standby built the DataFrame cold (0.4 s on the demo)."""
    from onceflow import CheckpointConfig, DeltaSink, Job
    from onceflow.errors import ConfigError
    from onceflow.runtime.standby import plan_job

    seen = []

    def source(sp, ctx):
        seen.append(ctx.start)
        return sp.readStream.format("onceflow-sequence").option("total", 10).load()

    def transform(df):
        seen.append("transform")
        return df.selectExpr("id", "key * 2 AS key")

    def make(src):
        return Job(name="ahead", source=src, transform=transform, sink=DeltaSink(str(tmp_path / "t")),
                   checkpoint=CheckpointConfig(str(tmp_path / "ckpt")))

    active = len(spark.streams.active)
    plan_job(spark, make(source))
    assert seen == ["resumed", "transform"]
    assert len(spark.streams.active) == active and not (tmp_path / "ckpt").exists()

    def broken(sp):
        raise ConfigError("broker down")

    with caplog.at_level("INFO", logger="onceflow.standby"):
        plan_job(spark, make(broken))
    assert "broker down" in caplog.text and "built at the takeover" in caplog.text


def test_a_waiting_standby_touches_its_python_workers_until_promoted(tmp_path):
    """Spark stops a Python worker pool idle for a minute: a standby that waited longer took
    over with fresh workers (pandas, pyarrow and the sink imported anew). While it waits,
    :func:`wait_for_go` runs ``warm`` every ``warm_every_s``, and stops at the go file. Old
    code: nothing ran while a standby waited."""
    import threading
    import time

    from onceflow.runtime.standby import wait_for_go

    go, stop, ran = str(tmp_path / "go"), threading.Event(), []
    threading.Timer(0.55, lambda: open(go, "w").close()).start()
    started = time.monotonic()
    assert wait_for_go(go, stop, warm=lambda: ran.append(time.monotonic() - started), warm_every_s=0.1)
    assert 3 <= len(ran) <= 6 and ran[0] >= 0.1, ran
    n = len(ran)
    stop.set()
    assert not wait_for_go(str(tmp_path / "never"), stop, warm=lambda: ran.append(0.0), warm_every_s=0.0)
    assert len(ran) == n  # stopped: nothing more runs


def test_keeping_warm_runs_python_workers_and_no_code_of_the_job(spark, tmp_path):
    """:func:`keep_warm` restarts the idle clocks of the pools a takeover uses (the warm-up
    query again: tasks, data-source planning, writing, the streaming sink's commit) without
    calling the job's source: a source that is down must not stall a waiting standby."""
    import psutil

    from onceflow import CheckpointConfig, DeltaSink, Job
    from onceflow.runtime.standby import keep_warm

    calls = []

    def source(sp):
        calls.append("source")
        raise AssertionError("the job's source must not run while the standby waits")

    job = Job(name="warm", source=source, sink=DeltaSink(str(tmp_path / "t")),
              checkpoint=CheckpointConfig(str(tmp_path / "ckpt")))
    keep_warm(spark, job, scratch=str(tmp_path / "scratch"))
    assert calls == [] and not (tmp_path / "ckpt").exists()
    assert list((tmp_path / "scratch").iterdir()) == []  # its throwaway table is gone
    def cmdline(p: psutil.Process) -> str:
        try:
            return " ".join(p.cmdline())
        except psutil.Error:  # gone, or a zombie a moment before its daemon reaps it
            return ""

    jvm = next(p for p in psutil.Process().children() if p.name() == "java")
    daemons = {p.pid for p in jvm.children() if any(d in cmdline(p) for d in DAEMONS)}
    workers = [p for p in jvm.children(recursive=True)  # forked by a daemon: idle in its pool now
               if p.ppid() in daemons and any(d in cmdline(p) for d in DAEMONS)]
    assert workers, [cmdline(p) for p in jvm.children(recursive=True)]


def test_the_first_warm_up_runs_many_batches_and_keeping_warm_one(spark, tmp_path):
    """The first warm-up query runs ``batches`` micro-batches of WARM_ROWS ids each, keeping
    warm one; each is stopped once done. Old code: one batch that found no ids (the sequence
    source's clock had only just started), so nothing of a batch with rows had run when a
    standby took over."""
    from onceflow.runtime.standby import WARM_ROWS, _until_done, warm_query

    def rows(name: str, batches: int) -> list[int]:
        (tmp_path / name).mkdir()
        q = warm_query(spark, str(tmp_path / name), batches)
        assert _until_done(q, batches, go=None) and not q.isActive
        return [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]

    assert rows("many", 3) == [WARM_ROWS] * 3
    assert rows("one", 1) == [WARM_ROWS]
