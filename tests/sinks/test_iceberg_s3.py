"""The Iceberg sink with its warehouse on S3 (moto's server, tests/s3_server.py).

One ``storage_options`` mapping (s3fs's or delta-rs's keys) serves the tasks' fsspec writes and
pyiceberg's FileIO (metadata, manifests, the footers ``add_files`` reads, the upsert's scans).
The output is read back independently: a pyiceberg catalog given its own ``s3.*`` properties,
and the data directory listed with boto3.

Before this change the S3 tests fail at the table's creation: the catalog had no ``s3.*``
properties, so pyiceberg's FileIO went to AWS (``Could not resolve host:
<bucket>.s3.us-east-1.amazonaws.com``, a SinkError "cannot create lake.t"); the translation
tests fail on the missing ``onceflow.sinks.iceberg.fileio``, and the Spark job also because
``IcebergSink.options()`` shipped only the sink's own options, never the job's.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark.sql.types import BooleanType, LongType, StringType, StructField, StructType

from onceflow.errors import ConfigError
from onceflow.sinks.base import Decision, TaskInfo

SCHEMA = StructType([StructField("id", LongType())])
USCHEMA = StructType([StructField("id", LongType()), StructField("v", StringType()),
                      StructField("_onceflow_delete", BooleanType())])


# ---- the translation -----------------------------------------------------------------------------


def test_storage_options_in_either_vocabulary_become_file_io_properties():
    from onceflow.sinks.iceberg.fileio import file_io_properties, with_storage

    s3fs_style = {"endpoint_url": "http://minio:9000", "key": "AK", "secret": "SK", "token": "ST",
                  "client_kwargs": {"region_name": "eu-west-1"}, "use_listings_cache": True}
    delta_style = {"AWS_ENDPOINT_URL": "http://minio:9000", "AWS_ACCESS_KEY_ID": "AK",
                   "AWS_SECRET_ACCESS_KEY": "SK", "AWS_SESSION_TOKEN": "ST", "AWS_REGION": "eu-west-1",
                   "AWS_ALLOW_HTTP": "true"}
    want = {"s3.endpoint": "http://minio:9000", "s3.access-key-id": "AK", "s3.secret-access-key": "SK",
            "s3.session-token": "ST", "s3.region": "eu-west-1"}
    assert file_io_properties("s3://lake/wh", s3fs_style) == want
    assert file_io_properties("s3a://lake/wh", delta_style) == want
    assert file_io_properties("s3://lake/wh", {"anon": True}) == {"s3.anonymous": "true"}
    # an endpoint without a region: us-east-1 (as s3fs signs), not a lookup at AWS
    assert file_io_properties("s3://lake/wh", {"endpoint_url": "http://m:9000"})["s3.region"] == (
        os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1")
    # what the user's catalog properties give (or their client.* aliases) is left to them
    given = {"s3.endpoint": "http://other:1", "client.access-key-id": "MINE", "client.region": "r"}
    assert file_io_properties("s3://lake/wh", s3fs_style, given) == {"s3.secret-access-key": "SK",
                                                                    "s3.session-token": "ST"}
    assert file_io_properties("abfss://c@acct.dfs.core.windows.net/wh", {"account_name": "acct",
                              "AZURE_STORAGE_ACCOUNT_KEY": "AZK"}) == {"adls.account-name": "acct",
                                                                       "adls.account-key": "AZK"}
    assert file_io_properties("/local/wh", s3fs_style) == {}
    # a spec: the options that apply to its warehouse, prefix-keyed ones picked by URL
    spec = {"name": "c", "type": "sql", "uri": "sqlite:///c.db", "warehouse": "s3://lake/wh"}
    keyed = {"s3://lake": {"endpoint_url": "http://lake:1"}, "s3://other": {"endpoint_url": "http://o:1"}}
    assert with_storage(spec, keyed)["s3.endpoint"] == "http://lake:1"
    assert with_storage({**spec, "warehouse": "file:///tmp/wh"}, s3fs_style) == {**spec, "warehouse": "file:///tmp/wh"}


@pytest.mark.parametrize("warehouse, options, message", [
    ("s3://lake/wh", {"profile": "prod"}, "storage option 'profile' has no pyiceberg FileIO counterpart for s3://"),
    ("gs://lake/wh", {"token": "/sa.json"}, "GOOGLE_APPLICATION_CREDENTIALS"),
    ("abfs://c/wh", {"connection_string": "AccountName=a;AccountKey=k"}, "give account_name with"),
])
def test_options_pyiceberg_cannot_take_are_one_clear_line(tmp_path, warehouse, options, message):
    from onceflow import IcebergSink

    with pytest.raises(ConfigError, match=message) as raised:
        IcebergSink(f"sqlite:///{tmp_path}/c.db", "lake.t", warehouse=warehouse, storage_options=options)
    assert "\n" not in str(raised.value)
    # the catalog's own FileIO properties make the option irrelevant: accepted
    IcebergSink({"type": "sql", "uri": f"sqlite:///{tmp_path}/c.db", "s3.profile-name": "prod",
                 "gcs.oauth2.token": "t", "adls.account-name": "a"}, "lake.t", warehouse=warehouse,
                storage_options=options)


def test_catalog_secrets_are_redacted_in_repr_and_spark_options(tmp_path):
    import re

    from onceflow import IcebergSink
    from onceflow.storage import SPARK_REDACTION, redact

    sink = IcebergSink({"type": "sql", "uri": f"sqlite:///{tmp_path}/c.db", "s3.secret-access-key": "S3cretValue9",
                        "adls.account-key": "AzureKey123"}, "lake.t", warehouse="s3://lake/wh")
    assert "S3cretValue9" not in repr(sink) and "AzureKey123" not in repr(sink)
    opts = sink.options()
    assert re.search(SPARK_REDACTION, opts["catalog"]), "Spark redacts the catalog option's value"
    assert "AzureKey123" not in redact('{"adls.account-key": "AzureKey123"}')


# ---- on moto's S3 server --------------------------------------------------------------------------


def _source(s3, tmp_path: Path, warehouse: str, write: str = "append"):
    from onceflow import IcebergSink

    kwargs = {"write": "upsert", "keys": ["id"], "delete_when": "v = 'del'"} if write == "upsert" else {}
    sink = IcebergSink(f"sqlite:///{tmp_path}/catalog.db", "lake.t", warehouse=warehouse,
                       storage_options=s3.options, **kwargs)
    ds = sink.data_source()
    schema = USCHEMA if write == "upsert" else SCHEMA
    ds.write_schema = schema
    ds.validate(schema, False)
    return ds, schema


def _rows(schema: StructType, ids: list[int], delete: tuple[int, ...] = ()) -> list[pa.RecordBatch]:
    cols = {"id": pa.array(ids, pa.int64())}
    if "v" in schema.fieldNames():
        cols |= {"v": pa.array([f"v{i}" for i in ids]), "_onceflow_delete": pa.array([i in delete for i in ids])}
    return pa.table(cols).to_batches()


def _reader(s3, tmp_path: Path):
    """The table through a pyiceberg catalog of its own, given pyiceberg's properties directly."""
    from pyiceberg.catalog.sql import SqlCatalog

    return SqlCatalog("onceflow", uri=f"sqlite:///{tmp_path}/catalog.db", **{
        "s3.endpoint": s3.endpoint, "s3.access-key-id": "testing", "s3.secret-access-key": "testing",
        "s3.region": "us-east-1"}).load_table("lake.t")


def _data_objects(s3, bucket: str) -> list[str]:
    import boto3

    client = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="wh/lake/t/data/")
    return sorted(o["Key"].rsplit("/", 1)[-1] for p in pages for o in p.get("Contents", []))


@pytest.mark.parametrize("write", ["append", "upsert"])
def test_on_s3_a_lost_reply_and_a_replay_commit_nothing_and_recovery_removes_orphans(s3, tmp_path, write):
    """Driver A decides batch 0 (two tasks, a losing attempt); its reply is lost
    (``after_catalog_commit``); it pre-commits batch 1 and dies. Driver B opens the sink: its
    recovery lists the data directory on S3 and deletes batch 1's file (an orphan of an older
    epoch); its replay of batch 0 finds the batch decided and commits nothing. Read back
    through an independent catalog: every row once, one snapshot per batch, no orphan object."""
    from onceflow.errors import InjectedCrash
    from onceflow.sinks.base import PreCommitted, TwoPhaseCommitWriter

    bucket = s3.bucket()
    warehouse = f"s3://{bucket}/wh"
    a, schema = _source(s3, tmp_path, warehouse, write)
    lineage = str(uuid.uuid4())
    a.opts.update(lineage=lineage, allow_unknown_fingerprint="true",
                  test_crash_at="after_catalog_commit@0:raise", test_crash_markers=str(tmp_path))
    epoch = a.open(lineage)
    messages = []
    for part, attempt, ids in ((0, 0, [1, 2]), (1, 0, [3, 4]), (1, 1, [3, 4])):
        handle, n = a.pre_commit(TaskInfo(lineage, 0, part, attempt), schema, False, iter(_rows(schema, ids)))
        if attempt == 1 or part == 0:  # attempt 0 of task 1 lost to attempt 1 (speculation)
            messages.append(PreCommitted(lineage, 0, part, attempt, n, handle))
    assert len(_data_objects(s3, bucket)) == 3
    with pytest.raises(InjectedCrash):
        TwoPhaseCommitWriter(a, schema, False).commit(messages, 0)
    a.decide(Decision(lineage, 0, "unknown", [m.handle for m in messages], epoch), schema, False)  # a retry
    orphan, _ = a.pre_commit(TaskInfo(lineage, 1, 0, 0), schema, False, iter(_rows(schema, [5], delete=(1,))))

    b, _ = _source(s3, tmp_path, warehouse, write)
    b.opts.update(lineage=lineage, allow_unknown_fingerprint="true")
    assert b.open(lineage) > epoch
    assert orphan["path"] not in _data_objects(s3, bucket), "recovery deleted the undecided batch's file"
    assert b.is_decided(lineage, 0)
    TwoPhaseCommitWriter(b, schema, False).commit([PreCommitted(lineage, 0, 0, 0, 0, None, True)], 0)

    table = _reader(s3, tmp_path)
    assert sorted(table.scan().to_arrow().column("id").to_pylist()) == [1, 2, 3, 4]
    batches = [s.summary.additional_properties.get("onceflow.batch") for s in table.metadata.snapshots]
    assert batches.count("0") == 1 and "1" not in batches
    live = {p.rsplit("/", 1)[-1] for p in table.inspect.all_files().column("file_path").to_pylist()}
    assert _data_objects(s3, bucket) == sorted(live), "nothing dangling: losing attempts and staged rows gone"
    assert all(p.startswith(f"s3://{bucket}/wh/lake/t/data/") for p in
               table.inspect.all_files().column("file_path").to_pylist())


def test_doctor_reads_an_s3_warehouse_with_the_cli_storage_options(s3, tmp_path):
    """``onceflow doctor --iceberg CATALOG TABLE --warehouse s3://...`` with the options in
    ONCEFLOW_STORAGE_OPTIONS (the ``s3`` fixture sets them), as the other CLI commands."""
    from click.testing import CliRunner

    from onceflow.cli.doctor import doctor

    bucket = s3.bucket()
    ds, schema = _source(s3, tmp_path, f"s3://{bucket}/wh")
    lineage = str(uuid.uuid4())
    epoch = ds.open(lineage)
    handle, _ = ds.pre_commit(TaskInfo(lineage, 0, 0, 0), schema, False, iter(_rows(schema, [1])))
    ds.decide(Decision(lineage, 0, "fp", [handle], epoch), schema, False)
    out = CliRunner().invoke(doctor, ["--iceberg", f"sqlite:///{tmp_path}/catalog.db", "lake.t",
                                      "--warehouse", f"s3://{bucket}/wh"])
    assert out.exit_code == 0, out.output
    for text in (f"table: lake.t at s3://{bucket}/wh/lake/t", "snapshots: 2 snapshot(s)",
                 f"lineage {lineage}: sink_id iceberg, append: epoch {epoch}, last decided batch 0"):
        assert text in out.output, out.output
    assert "testing" not in out.output
