"""Each job in examples/ runs for a few batches under ``onceflow run`` against real services
(issue 31). Kafka -> PostgreSQL runs in tests/test_install.py, from a fresh pip install."""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from deltalake import DeltaTable

from kafka_broker import KafkaBroker, create_topic, produce
from kinesis_server import CREDS, Kinesalite
from onceflow.verify.exactly_once import check_delta_table

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
pytestmark = pytest.mark.slow


def onceflow(*cmd, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "onceflow", *map(str, cmd)], cwd=cwd, capture_output=True,
                       text=True, timeout=300,
                       env={**os.environ, "ONCEFLOW_SPARK_LOG_LEVEL": "ERROR", **(env or {})})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r


def test_no_example_imports_the_demo():
    for f in EXAMPLES.glob("*.py"):
        assert "onceflow.demo" not in f.read_text(), f.name


def test_kafka_to_partitioned_delta(tmp_path):
    views = [{"user": f"u{i % 7}", "page": f"/p{i % 3}", "ts": f"2026-11-{25 + i % 3}T10:{i % 60:02d}:00Z"}
             for i in range(120)]
    with KafkaBroker() as broker:
        create_topic(broker.bootstrap, "views")
        produce(broker.bootstrap, "views", [json.dumps(v) for v in views])
        onceflow("run", "--no-standby", EXAMPLES / "kafka_to_delta.py", "--", "--bootstrap", broker.bootstrap,
                 "--table", tmp_path / "views", "--checkpoint", tmp_path / "ckpt", "--stop-when-idle", "3",
                 cwd=tmp_path)
    table = DeltaTable(str(tmp_path / "views"))
    assert table.metadata().partition_columns == ["day"]
    rows = table.to_pyarrow_table().to_pylist()
    assert sorted(r["offset"] for r in rows) == list(range(120))  # every record once
    assert {(r["user"], r["page"], r["day"]) for r in rows} == {
        (v["user"], v["page"], v["ts"][:10]) for v in views}
    # Hive-style directories (below each attempt's directory): one file per day and task
    days = {re.search(r"/day=([0-9-]+)/[^/]+[.]parquet$", uri).group(1) for uri in table.file_uris()}
    assert days == {"2026-11-25", "2026-11-26", "2026-11-27"}


def test_kinesis_to_delta(tmp_path):
    stream = f"readings-{uuid.uuid4().hex[:6]}"
    with Kinesalite() as kinesis:
        kinesis.create_stream(stream, shards=2)
        kinesis.put(stream, [(f"d{i % 5}", json.dumps({"device": f"d{i % 5}", "reading": i / 2}).encode())
                             for i in range(200)])
        env = {"AWS_ACCESS_KEY_ID": CREDS["aws_access_key_id"],
               "AWS_SECRET_ACCESS_KEY": CREDS["aws_secret_access_key"]}
        onceflow("run", "--no-standby", EXAMPLES / "kinesis_to_delta.py", "--", "--stream", stream,
                 "--region", CREDS["region_name"], "--endpoint-url", kinesis.endpoint,
                 "--table", tmp_path / "readings", "--checkpoint", tmp_path / "ckpt", "--stop-when-idle", "3",
                 cwd=tmp_path, env=env)
    rows = DeltaTable(str(tmp_path / "readings")).to_pyarrow_table().to_pylist()
    assert sorted(r["reading"] for r in rows) == [i / 2 for i in range(200)]
    assert len({r["sequenceNumber"] for r in rows}) == 200
    assert all(isinstance(r["arrived"], datetime.datetime) for r in rows)


def test_stateful_job_upgraded_through_a_savepoint_keeps_its_state(tmp_path):
    """Version 1 counts 3,000 events, a savepoint, version 2 (one more column) restored from it
    counts on to 6,000: every id once, and each key's running count continues where it was."""
    job, out = EXAMPLES / "counts_to_delta.py", tmp_path / "out"
    onceflow("run", "--no-standby", job, "--", "--out", out, "--total", 3000, "--rate", 1500,
             "--stop-when-idle", 2, cwd=tmp_path)
    onceflow("savepoint", "create", out / "checkpoint", tmp_path / "sp", cwd=tmp_path)
    onceflow("run", "--no-standby", "--from-savepoint", tmp_path / "sp", "--checkpoint", out / "checkpoint-v2",
             job, "--", "--v2", "--out", out, "--total", 6000, "--rate", 1500, "--stop-when-idle", 2,
             cwd=tmp_path)
    report = check_delta_table(str(out / "events"), 6000)
    assert report.ok and report.state_errors == 0, report
    rows = DeltaTable(str(out / "events")).to_pyarrow_table(columns=["id", "key", "bucket"]).to_pylist()
    assert all((r["bucket"] is None) == (r["id"] < 3000) for r in rows)
    assert all(r["bucket"] == r["key"] % 4 for r in rows if r["id"] >= 3000)
