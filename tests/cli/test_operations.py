"""Flink-shaped operations on a real ``onceflow run``: job arguments reach every process that
loads the job file, ``onceflow list`` shows the job running then stopped, ``onceflow cancel``
stops it without the savepoint a SIGTERM would take; a path that is no checkpoint is an
error on every command that takes one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from onceflow.checkpoint.layout import CheckpointDir

JOB = textwrap.dedent(
    """
    import json, logging, os, sys, time
    from pyspark.sql import functions as F
    from onceflow import CheckpointConfig, DeltaSink, Job

    with open(os.environ["WORK"] + "/argv.jsonl", "a") as f:  # every process that loads the file
        f.write(json.dumps({"pid": os.getpid(), "argv": sys.argv}) + "\\n")
    logging.getLogger("ops.job").debug("loaded with %s", sys.argv[1:])

    SLOW = os.environ["WORK"] + "/slow"

    def same(x):  # one second a row once the test makes batches slow
        if os.path.exists(SLOW):
            time.sleep(1)
        return x

    job = Job(name="ops-job",
              source=lambda spark: spark.readStream.format("onceflow-sequence")
              .option("total", 10**9).option("rows_per_second", 200).load(),
              transform=lambda df: df.withColumn("id", F.udf(same, "long")("id")),
              sink=DeltaSink(os.environ["WORK"] + "/table"),
              checkpoint=CheckpointConfig(os.environ["WORK"] + "/jobs/a/ckpt", interval=0))
    """
)


def onceflow(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onceflow", *args], env=env or dict(os.environ),
                          capture_output=True, text=True, timeout=timeout)


def one_error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    return line


def argv_lines(work) -> list[dict]:
    try:
        return [json.loads(x) for x in open(work / "argv.jsonl")]
    except FileNotFoundError:
        return []


@pytest.mark.parametrize("command", [["stop"], ["cancel"], ["checkpoints"], ["savepoint", "create"],
                                     ["savepoint", "list"], ["state", "export", "--operator", "0",
                                                             "--out", "x.parquet"], ["list"]])
def test_a_path_that_is_no_checkpoint_is_an_error(tmp_path, command):
    r = onceflow(*command, str(tmp_path / "typo"))
    assert "does not exist" in one_error_line(r) or "neither a savepoint nor" in r.stderr, r.stderr
    if command[0] in ("stop", "cancel", "checkpoints"):  # an existing directory that is no checkpoint
        assert "is not a onceflow checkpoint" in one_error_line(onceflow(*command, str(tmp_path)))


def test_args_list_and_cancel_on_a_running_job(tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    env = {**os.environ, "WORK": str(tmp_path), "ONCEFLOW_SPARK_LOG_LEVEL": "ERROR"}
    ckpt = CheckpointDir(str(tmp_path / "jobs" / "a" / "ckpt"))
    (tmp_path / "jobs" / "b").mkdir(parents=True)  # no checkpoint: not listed
    sps = tmp_path / "sps"
    sup = subprocess.Popen([sys.executable, "-m", "onceflow", "--log-format", "json", "run",
                            "--log-level", "DEBUG", str(tmp_path / "job.py"),
                            "--savepoint-dir", str(sps), "--", "--topic", "a b", "-v"],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 150
        # supervisor, active driver, and the warm standby (started after the first commit)
        while len(argv_lines(tmp_path)) < 3 or ckpt.last_committed() is None:
            assert sup.poll() is None, sup.communicate()
            assert time.monotonic() < deadline, (argv_lines(tmp_path), ckpt.last_committed())
            time.sleep(0.3)
        lines = argv_lines(tmp_path)
        assert [x["argv"] for x in lines] == [[str(tmp_path / "job.py"), "--topic", "a b", "-v"]] * 3
        assert len({x["pid"] for x in lines}) == 3

        r = onceflow("list", str(tmp_path), "--json")
        assert r.returncode == 0, r.stderr
        (job,) = json.loads(r.stdout)
        assert job["name"] == "ops-job" and job["state"] == "running", job
        assert job["holder_pid"] == lines[1]["pid"] and job["holder_epoch"] == 1
        assert job["last_batch"] is not None and 0 <= job["last_batch_age_s"] < 60
        assert job["lag"] is None and job["checkpoint"] == ckpt.url
        r = onceflow("list", str(tmp_path))
        assert "ops-job" in r.stdout and "running" in r.stdout and f"{lines[1]['pid']} e1" in r.stdout

        # cancel stops at once: the in-flight batch (a second per row now) is abandoned
        (tmp_path / "slow").touch()
        committed = ckpt.last_committed()
        time.sleep(3)  # the next batch is under way, for minutes
        t0 = time.monotonic()
        r = onceflow("cancel", ckpt.url, env=env)
        cancelled_s = time.monotonic() - t0
        assert r.returncode == 0 and "cancelled supervisor pid" in r.stdout, r.stderr
        out, err = sup.communicate(timeout=60)
        assert cancelled_s < 30, f"cancel waited {cancelled_s:.0f} s for the in-flight batch"
        assert ckpt.last_committed() <= committed + 1  # at most the batch that was committing
    finally:
        if sup.poll() is None:
            sup.kill()
    assert sup.returncode == 0, err
    assert not sps.exists() and "savepoint" not in out  # 'onceflow run' takes one on SIGTERM
    # --log-level/--log-format reach the driver and the standby (Spark's JVM logs on its own)
    records = [json.loads(ln) for ln in err.splitlines() if ln.startswith("{")]
    assert {r["role"] for r in records} >= {"supervisor", "driver", "standby"}, err[-3000:]
    mine = [r for r in records if r["logger"] == "ops.job"]
    assert {r["role"] for r in mine} == {"supervisor", "driver", "standby"} and {r["level"] for r in mine} == {"DEBUG"}
    assert {r["pid"] for r in mine} == {x["pid"] for x in lines}
    assert all(r["job"] == "ops-job" for r in records if r["role"] != "supervisor" and r["logger"] != "ops.job")
    assert all(set(r) >= {"time", "level", "logger", "message", "job", "pid"} for r in records)
    (job,) = json.loads(onceflow("list", str(tmp_path), "--json").stdout)
    assert job["state"] == "stopped" and job["last_batch"] == ckpt.last_committed()


def test_log_format_json_makes_errors_json_lines_too(tmp_path):
    r = onceflow("--log-format", "json", "stop", str(tmp_path / "typo"))
    assert r.returncode == 2 and r.stdout == "", r.stderr
    (record,) = [json.loads(ln) for ln in r.stderr.splitlines()]
    assert record["level"] == "ERROR" and record["message"].endswith("typo does not exist: give the "
                                                                      "checkpoint directory of a job")
    r = onceflow("--log-level", "LOUD", "list", str(tmp_path))
    assert r.returncode == 2 and "Invalid value for '--log-level': 'LOUD'" in r.stderr
