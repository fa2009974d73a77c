"""``onceflow run --dry-run``: everything a start checks, nothing a start writes.

It loads the job (with its arguments), applies the options, reads the checkpoint (lineage,
last committed batch) or checks that it can be created, checks a restore (``--from-savepoint``)
without copying, starts a SparkSession and builds the job's streaming DataFrame and its
query plan (no query starts, no batch is planned), opens the sink read-only
(:func:`onceflow.sinks.preflight.preflight`: options, target, permissions) and reports the
sink's guarantee. Errors are the OnceflowErrors a real start would raise.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable

from onceflow import logs
from onceflow.checkpoint.layout import CheckpointDir
from onceflow.errors import ConfigError, OnceflowError, SinkError
from onceflow.runtime.launch import LaunchOptions, apply_overrides, driver_env, restore_request
from onceflow.runtime.loader import load_job
from onceflow.runtime.runner import driver_spark
from onceflow.savepoint.context import checkpoint_context
from onceflow.sinks.preflight import preflight
from onceflow.spark import cli_conf, register_all


def _checkpoint_line(ckpt: CheckpointDir) -> str:
    if ckpt.exists():
        last = ckpt.last_committed()
        return (f"checkpoint  {ckpt.url}: lineage {ckpt.read_lineage()}, "
                f"{'no batch committed' if last is None else f'last committed batch {last}'}")
    if ckpt.fs.exists(ckpt.path):
        if not ckpt.fs.isdir(ckpt.path):
            raise ConfigError(f"checkpoint directory {ckpt.url} is a file")
        return f"checkpoint  {ckpt.url}: empty, the job starts fresh"
    if "://" not in ckpt.url or ckpt.url.startswith("file:"):
        p = os.path.abspath(ckpt.path)
        while not os.path.exists(p):
            p = os.path.dirname(p)
        if not (os.path.isdir(p) and os.access(p, os.W_OK | os.X_OK)):
            raise ConfigError(f"checkpoint directory {ckpt.url} is not writable (cannot be created "
                              f"in {p})")
    return f"checkpoint  {ckpt.url}: absent, created at start"


def dry_run(target: str, options: LaunchOptions, say: Callable[[str], None]) -> None:
    """Check ``target`` as ``onceflow run`` would start it (see module doc); ``say`` prints."""
    logs.configure("dry-run")
    options.check()
    job = load_job(target, options.args)
    logs.set_job(job.name)
    restore = restore_request(options.from_savepoint, options.fork, options.rescale,
                              options.allow_non_restored_state)
    os.environ.update(driver_env(options, os.environ))  # what the drivers would see (--conf ...)
    apply_overrides(job, os.environ)
    ckpt = CheckpointDir(job.checkpoint.directory)
    say(f"job         {job.name} ({target}); restarts: {job.restart_strategy.describe()}")
    if restore is not None:
        restore.check(ckpt.url)  # manifest, files, an empty target: before Spark starts
    else:
        say(_checkpoint_line(ckpt))
    spark = driver_spark(job, ckpt.url)
    register_all(spark)
    for key, value in {**job.checkpoint.spark_conf(), **job.spark_conf, **cli_conf()}.items():
        if key.startswith("spark.sql."):
            spark.conf.set(key, value)
    if restore is not None:
        m = restore.check(ckpt.url, job=job, spark=spark)
        say(f"restore     savepoint {options.from_savepoint} into {ckpt.url}: batch {m.batch} of "
            f"job {m.job}, its operators fit the job")
    spark.conf.set("spark.onceflow.checkpointLocation", ckpt.url)
    plan = io.StringIO()
    try:
        df = job.dataframe(spark, checkpoint_context(ckpt))
        if df.isStreaming:
            with contextlib.redirect_stdout(plan):
                df.explain()
    except OnceflowError:
        raise
    except Exception as e:  # the job's source or transform: its own message, one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"job {job.name}: building its streaming DataFrame failed: "
                          f"{type(e).__name__}: {first}") from None
    if not df.isStreaming:
        raise ConfigError(f"job {job.name}: the source must be a streaming DataFrame (spark.readStream...)")
    say(f"schema      {df.schema.simpleString()}")
    say("plan")
    for line in plan.getvalue().strip().splitlines():
        say(f"  {line}")
    sink = job.sink.for_session(spark)
    sink.check_output_mode(job.output_mode)
    source = sink.data_source({**sink.options(), "checkpointlocation": ckpt.url})
    source.write_schema = df.schema
    complete = job.output_mode == "complete"
    try:
        lines = preflight(source, df.schema, complete)
    except OnceflowError:
        raise
    except Exception as e:  # a storage or client library's own error
        raise SinkError(f"{source.format_name}: {type(e).__name__}: {e}") from None
    for line in lines:
        say(f"sink        {source.format_name}: {line}")
    say(f"guarantee   {source.format_name}: {source.describe_guarantee()}")
    say("dry run: OK (nothing was written; no batch ran)")
