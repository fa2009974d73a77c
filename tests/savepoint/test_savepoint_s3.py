"""Savepoints on S3 (moto's server): create, list, inspect (CLI too), restore, dispose.

Spark's own checkpoint stays local (no Hadoop S3 connector can be installed here); the
savepoint goes to ``s3://`` and the job resumes from there. Without the object-store changes
this fails at ``create_savepoint``: the options in ONCEFLOW_STORAGE_OPTIONS never reached s3fs,
so the copy went to AWS instead of the test server.
"""

from __future__ import annotations

import pyarrow.parquet as pq
from click.testing import CliRunner
from deltalake import DeltaTable

from onceflow.checkpoint.layout import CheckpointDir
from onceflow.cli.main import main
from onceflow.demo.job import transform as running_count
from onceflow.job import CheckpointConfig, Job
from onceflow.runtime.restart import fixed_delay
from onceflow.savepoint import (
    create_savepoint,
    dispose_savepoint,
    inspect_savepoint,
    list_savepoints,
    read_manifest,
)
from onceflow.sinks.delta import DeltaSink
from onceflow.storage import url_to_fs

KEYS = 16


def counting_job(ckpt, table, total: int) -> Job:
    def source(spark):
        return (spark.readStream.format("onceflow-sequence").option("total", total)
                .option("rows_per_second", 10_000_000).option("max_rows_per_batch", 1000)
                .option("keys", KEYS).load())

    return Job(name="counts", source=source, transform=running_count, sink=DeltaSink(str(table)),
               checkpoint=CheckpointConfig(str(ckpt), interval=0),
               restart_strategy=fixed_delay(attempts=1, delay=0), stop_when_idle=0.5)


def rows(table) -> list[tuple[int, int]]:
    out = []
    for uri in DeltaTable(str(table)).file_uris():
        t = pq.read_table(uri.removeprefix("file://"), columns=["id", "running_count"])
        out.extend(zip(t["id"].to_pylist(), t["running_count"].to_pylist(), strict=True))
    return sorted(out)


def test_savepoint_on_s3_create_inspect_restore_dispose(spark, s3, tmp_path):
    bucket = s3.bucket()
    ckpt, table = tmp_path / "ckpt", tmp_path / "table"
    counting_job(ckpt, table, 1000).run(spark=spark)
    target, manifest = create_savepoint(str(ckpt), f"s3a://{bucket}/savepoints/sp1")
    assert manifest.operators and manifest.source_offsets == [{"next": 1000}]
    fs, root = url_to_fs(target)
    assert fs.exists(f"{root}/_savepoint.json") and fs.exists(f"{root}/checkpoint/metadata")
    assert not [r for r in s3.requests if "/savepoints/" in r[1] and r[3]]  # written, never copied/renamed

    assert inspect_savepoint(f"s3://{bucket}/savepoints/sp1").verified is True
    assert [url for url, _ in list_savepoints(f"s3://{bucket}/savepoints")] == [f"s3://{bucket}/savepoints/sp1"]
    result = CliRunner().invoke(main, ["savepoint", "inspect", f"s3a://{bucket}/savepoints/sp1"])
    assert result.exit_code == 0 and "testing" not in result.output, result.output

    restored = tmp_path / "restored"
    counting_job(restored, table, 2000).run(spark=spark, from_savepoint=target)
    assert CheckpointDir(str(restored)).lineage == manifest.lineage  # resumed, same lineage
    assert rows(table) == [(i, i // KEYS + 1) for i in range(2000)]  # exactly once, state restored

    fs.rm(f"{root}/checkpoint/commits/{manifest.batch}")  # damaged on S3: inspect says so
    damaged = inspect_savepoint(target)
    assert damaged.verified is False and any("missing" in p for p in damaged.problems)
    dispose_savepoint(target)
    assert not fs.exists(f"{root}/_savepoint.json") and read_manifest is not None
