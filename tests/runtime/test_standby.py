"""The standby's go file: what the supervisor tells a promoted standby about the lease."""

from __future__ import annotations

from onceflow.runtime.standby import promote, takes_over


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
