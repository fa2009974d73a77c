"""``onceflow list``'s search and states from event logs as the supervisor and runner write
them (a running job, with a live lease, is in tests/cli/test_operations.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from onceflow.checkpoint.eventlog import EventLog
from onceflow.checkpoint.jobs import find_checkpoints, job_status


def _log(path, *events: dict) -> None:
    log = EventLog(str(path))
    for e in events:
        log.append(e.pop("event"), **e)


def test_search_finds_checkpoints_but_not_inside_them_savepoints_or_tables(tmp_path):
    _log(tmp_path / "a" / "ckpt", {"event": "start", "job": "a"})
    (tmp_path / "a" / "ckpt" / "offsets").mkdir()
    (tmp_path / "b" / "deep" / "er" / "ckpt").mkdir(parents=True)
    (tmp_path / "b" / "deep" / "er" / "ckpt" / "metadata").write_text('{"id":"x"}\n')
    sp = tmp_path / "savepoints" / "sp-1" / "checkpoint"
    sp.mkdir(parents=True)
    (sp / "metadata").write_text('{"id":"x"}\n')
    (tmp_path / "savepoints" / "sp-1" / "_savepoint.json").write_text("{}")
    (tmp_path / "table" / "_delta_log").mkdir(parents=True)
    assert find_checkpoints(str(tmp_path)) == [f"{tmp_path}/a/ckpt", f"{tmp_path}/b/deep/er/ckpt"]
    assert find_checkpoints(str(tmp_path), depth=2) == [f"{tmp_path}/a/ckpt"]
    assert find_checkpoints(str(tmp_path / "a" / "ckpt")) == [f"{tmp_path}/a/ckpt"]


def test_states_from_the_event_log(tmp_path):
    start = {"event": "start", "job": "j"}
    cases = {
        "stopped": [start, {"event": "stop", "job": "j", "reason": "stopped"},
                    {"event": "stop", "reason": "signal", "exit_code": 0, "scope": "process"}],
        "finished": [start, {"event": "stop", "reason": "finished", "exit_code": 0, "scope": "process"}],
        "fenced": [start, {"event": "failed", "cause": "newer epoch", "error": "FencedError"},
                   {"event": "stop", "reason": "fenced", "exit_code": 5, "scope": "process"}],
        "config": [start, {"event": "failed", "cause": "bad", "error": "ConfigError"},
                   {"event": "stop", "reason": "config_error", "exit_code": 2, "scope": "process"}],
        "gave_up": [start, {"event": "gave_up", "attempts": 3, "scope": "process"}],
        "vanished": [{"event": "process_start", "supervisor_pid": 1, "host": "elsewhere", "scope": "process"},
                     start],
        "stop_failed": [start, {"event": "stop", "reason": "signal", "exit_code": 4, "scope": "process"}],
    }
    want = {"stopped": "stopped", "finished": "stopped", "fenced": "fenced", "config": "failed",
            "gave_up": "failed", "vanished": "failed", "stop_failed": "failed"}
    for name, events in cases.items():
        _log(tmp_path / name, *[dict(e) for e in events])
        status = job_status(str(tmp_path / name))
        assert (status.name, status.state) == ("j", want[name]), name


def test_a_supervisor_waiting_to_restart_is_restarting_and_lag_is_read_from_batches(tmp_path):
    import socket

    from onceflow.process import start_time

    sup = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ckpt = tmp_path / "ckpt"
        (ckpt / "commits").mkdir(parents=True)
        (ckpt / "commits" / "0").write_text("v1\n{}\n")
        _log(ckpt, {"event": "process_start", "supervisor_pid": sup.pid, "host": socket.gethostname(),
                    "supervisor_started": start_time(sup.pid), "scope": "process"},
             {"event": "start", "job": "j"},
             {"event": "batch", "batch": 0, "lag": {"t": {"0": 5, "1": 7}}},
             {"event": "restart", "cause": "crash", "scope": "process"})
        status = job_status(str(ckpt))
        assert status.state == "restarting" and status.last_batch == 0 and status.lag == 12
        assert 0 <= status.age_s() < 30
        out = subprocess.run([sys.executable, "-m", "onceflow", "list", str(tmp_path), "--json"],
                             capture_output=True, text=True, timeout=60, env=dict(os.environ))
        (row,) = json.loads(out.stdout)
        assert row["state"] == "restarting" and row["lag"] == 12 and row["holder_pid"] is None
    finally:
        sup.kill()
        sup.wait()
    assert job_status(str(ckpt)).state == "failed"  # the supervisor vanished without a stop


def test_kinesis_lag_in_seconds_is_the_largest_shards(tmp_path):
    """A batch event with ``lag_ms`` per stream and shard (Kinesis) lists the largest shard's
    lag in seconds; ``onceflow list`` shows it with its unit."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "commits").mkdir(parents=True)
    (ckpt / "commits" / "0").write_text("v1\n{}\n")
    _log(ckpt, {"event": "start", "job": "k"},
         {"event": "batch", "batch": 0, "lag_ms": {"orders": {"shardId-0": 2500, "shardId-1": 0}}},
         {"event": "stop", "job": "k", "reason": "finished"})
    status = job_status(str(ckpt))
    assert status.lag is None and status.lag_s == 2.5
    out = subprocess.run([sys.executable, "-m", "onceflow", "list", str(tmp_path)],
                         capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert out.returncode == 0 and "2.5 s" in out.stdout, out.stdout + out.stderr
