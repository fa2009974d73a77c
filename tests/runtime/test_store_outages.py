"""Storage outages are waited out, never an end (issue: a checkpoint store that errs for a
minute). Real moto S3 server answering HTTP 503 for a while; real processes for the supervisor.

Before: the runner's write probe turned any error but ENOSPC into a fatal CheckpointError
(exit 2, no restart)."""

from __future__ import annotations

import json
import logging
import time

import pytest

from onceflow.errors import CheckpointError
from onceflow.runtime.runner import check_checkpoint_dir


def test_the_checkpoint_probe_waits_out_a_store_outage(s3, caplog, monkeypatch):
    # botocore's own retries off: s3fs alone then gives up after 3-5 s of 503s
    monkeypatch.setenv("ONCEFLOW_STORAGE_OPTIONS", json.dumps(
        {**s3.options, "config_kwargs": {"retries": {"max_attempts": 1}}}))
    ckpt = f"s3://{s3.bucket()}/ckpt"
    s3.rule(kind="fail", until=time.time() + 12)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="onceflow.runner"):
        check_checkpoint_dir(ckpt)
    assert time.monotonic() - started >= 8
    waits = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    assert waits and f"writing to the checkpoint directory {ckpt} failed" in waits[0]


def test_a_path_under_a_file_is_still_refused_at_once(tmp_path):
    (tmp_path / "file").write_text("x")
    started = time.monotonic()
    with pytest.raises(CheckpointError, match="not writable"):
        check_checkpoint_dir(str(tmp_path / "file" / "ckpt"))
    assert time.monotonic() - started < 5


def test_the_supervisor_outlives_an_outage_of_its_event_log(s3, monkeypatch, caplog):
    """Before: EventLog.size()/append() raised out of Supervisor.run (a traceback, the job gone)."""
    import sys

    from onceflow.runtime.restart import fixed_delay
    from onceflow.runtime.supervisor import Supervisor

    monkeypatch.setenv("ONCEFLOW_STORAGE_OPTIONS", json.dumps(
        {**s3.options, "config_kwargs": {"retries": {"max_attempts": 1}}}))
    ckpt = f"s3://{s3.bucket()}/ckpt"
    s3.rule(kind="fail", until=time.time() + 600)
    child = [sys.executable, "-c", "pass"]
    with caplog.at_level(logging.WARNING, logger="onceflow.supervisor"):
        rc = Supervisor("job.py", fixed_delay(0), ckpt, child_cmd=child).run()
    assert rc == 0
    assert any("unreachable" in r.getMessage() for r in caplog.records)
