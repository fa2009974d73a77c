"""CLI: onceflow run -> stop --savepoint -> savepoint inspect/list -> run --from-savepoint,
checkpoints, state export, and the CLI's refusals (real processes, real Spark)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from onceflow.checkpoint.layout import CheckpointDir
from onceflow.cli.main import main
from onceflow.errors import EXIT_OK, EXIT_SAVEPOINT_FAILED
from onceflow.runtime import driver
from onceflow.runtime.launch import CHECKPOINT_ENV
from onceflow.savepoint.operations import SAVEPOINT_DIR_ENV
from onceflow.savepoint.restore import RestoreRequest, restore_env
from onceflow.verify.exactly_once import check_delta_table

JOB = textwrap.dedent(
    """
    import json, os
    from onceflow import CheckpointConfig, DeltaSink, Job, fixed_delay
    from onceflow.demo.job import transform

    def source(spark, ctx):  # records how each run started (the RestoreContext)
        with open(os.environ["WORK"] + "/starts.jsonl", "a") as f:
            f.write(json.dumps({"start": ctx.start, "attempt": ctx.attempt, "savepoint": ctx.savepoint,
                                "lineage": ctx.lineage}) + "\\n")
        return (spark.readStream.format("onceflow-sequence")
                .option("total", int(os.environ["TOTAL"])).option("rows_per_second", 2000)
                .option("max_rows_per_batch", 1000).option("keys", 16).load())

    job = Job(name="cli-counts", source=source, transform=transform,
              sink=DeltaSink(os.environ["WORK"] + "/table"),
              checkpoint=CheckpointConfig(os.environ["WORK"] + "/ckpt", interval=0),
              restart_strategy=fixed_delay(attempts=1, delay=0), stop_when_idle=1.0)
    """
)


OTHER = """
def transform(df):  # a different stateful operator at id 0
    return df.groupBy("key").count().selectExpr("key AS id", "count AS running_count")
"""


def onceflow(*args: str, env: dict, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "onceflow", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def wait_for_commits(ckpt: CheckpointDir, n: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while len(ckpt.committed_batches()) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the job committed no batches"
        time.sleep(0.3)


def test_sigterm_stops_with_savepoint_then_resume_and_stop_savepoint_again(spark, tmp_path, monkeypatch, capsys):
    (tmp_path / "job.py").write_text(JOB)
    env = {**os.environ, "WORK": str(tmp_path), "TOTAL": "40000", "ONCEFLOW_SPARK_LOG_LEVEL": "ERROR"}
    ckpt = CheckpointDir(str(tmp_path / "ckpt"))
    sps = tmp_path / "sps"
    sup = onceflow("run", "--no-standby", str(tmp_path / "job.py"), "--savepoint-dir", str(sps), env=env)
    try:
        wait_for_commits(ckpt, 3, sup)
        sup.send_signal(signal.SIGTERM)  # docs/savepoints.md: SIGTERM stops with a savepoint
        out, err = sup.communicate(timeout=180)
    finally:
        if sup.poll() is None:
            sup.kill()
    assert sup.returncode == 0, err
    (name,) = os.listdir(sps)
    sp = str(sps / name)
    assert name.startswith("cli-counts-") and f"savepoint {sp}: job cli-counts" in out
    assert f"savepoint on stop: {sp}" in err  # the supervisor says where it went
    saved = json.loads(open(f"{sp}/_savepoint.json").read())
    stopped_at = saved["source_offsets"][0]["next"]
    assert 0 < stopped_at < 40000 and saved["batch"] == ckpt.last_committed()

    cli = CliRunner()
    r = cli.invoke(main, ["savepoint", "inspect", sp])
    assert r.exit_code == 0, r.output
    assert f"source[0] = {{\"next\": {stopped_at}}}" in r.output
    assert "operator    0 applyInPandasWithState: 4 partitions" in r.output and "checksums   OK" in r.output
    r = cli.invoke(main, ["savepoint", "list", str(sps), "--json"])
    assert [s["batch"] for s in json.loads(r.output)] == [saved["batch"]]
    r = cli.invoke(main, ["checkpoints", str(ckpt.url), "--json", "--limit", "0"])
    batches = json.loads(r.output)
    committed = [b for b in batches if b["status"] == "committed"]
    assert committed[-1]["batch"] == saved["batch"]
    assert all(b["status"] == "planned" for b in batches if b["batch"] > saved["batch"])  # stopped before running
    assert sum(b["input_rows"] or 0 for b in committed) == stopped_at
    assert all(b["sink_commit_s"] is not None for b in batches if b["input_rows"])
    r = cli.invoke(main, ["checkpoints", str(ckpt.url)])
    assert "input rows" in r.output and "sink commit" in r.output

    # State export from the savepoint: one row per key, counts add up to the saved offset.
    r = cli.invoke(main, ["state", "export", sp, "--operator", "0", "--out", str(tmp_path / "s.parquet")])
    assert r.exit_code == 0, r.output
    state = pq.read_table(tmp_path / "s.parquet").to_pylist()
    assert len(state) == 16 and sum(row["value"]["groupState"]["count"] for row in state) == stopped_at

    # Refusals before any driver starts, nothing written: the job's own (non-empty) checkpoint,
    # options without a savepoint, --rescale 0, --rescale of HDFS-backed state.
    r = cli.invoke(main, ["run", str(tmp_path / "job.py"), "--from-savepoint", sp], env=env)
    assert r.exit_code == 2 and "not empty" in r.output
    r = cli.invoke(main, ["run", str(tmp_path / "job.py"), "--fork"], env=env)
    assert r.exit_code == 2 and "need --from-savepoint" in r.output
    for rescale, msg in (("0", "give a number of state partitions >= 1"), ("3", "needs the RocksDB state store")):
        r = cli.invoke(main, ["run", str(tmp_path / "job.py"), "--from-savepoint", sp, "--rescale", rescale,
                              "--checkpoint", str(tmp_path / "nowhere")], env=env)
        assert r.exit_code == 2 and msg in r.output, r.output
        assert not (tmp_path / "nowhere").exists()
    # A different job: the driver's operator check (needs Spark) refuses; still nothing left.
    (tmp_path / "other.py").write_text(JOB.replace("from onceflow.demo.job import transform", OTHER))
    other = onceflow("run", "--no-standby", str(tmp_path / "other.py"), "--from-savepoint", sp, "--checkpoint",
                     str(tmp_path / "nowhere"), env=env)
    _, err = other.communicate(timeout=180)
    assert other.returncode == 2 and "operator 0 is StateStoreSave in the job" in err, err
    assert not (tmp_path / "nowhere").exists()

    # Resume under 'onceflow run --from-savepoint', then 'onceflow stop --savepoint TARGET'.
    # The driver pauses (SIGSTOP) once it has stopped and freed the lease, before it takes the
    # savepoint asked for: 'onceflow stop' must wait for it, not take one into the same target
    # itself. (It did, when its poll fell in that window: a fresh-clone suite run; the driver
    # then failed on the non-empty target, or the stop did.)
    ckpt2 = CheckpointDir(str(tmp_path / "ckpt2"))
    markers = tmp_path / "markers"
    markers.mkdir()
    env2 = {**env, "ONCEFLOW_CRASH_AT": "before_stop_savepoint:pause", "ONCEFLOW_CRASH_MARKER_DIR": str(markers)}
    sup = onceflow("run", "--no-standby", str(tmp_path / "job.py"), "--from-savepoint", sp, "--checkpoint", ckpt2.url,
                   env=env2)
    try:
        wait_for_commits(ckpt2, 4, sup)  # batch N-1 and N restored, two new ones
        sp2 = str(tmp_path / "sp2")
        # From another host (its own host name; no signal can reach the driver): the driver
        # polls the stop request that 'onceflow stop' leaves in the checkpoint.
        stopper = subprocess.Popen(
            ["unshare", "--uts", "sh", "-c", 'hostname ops-laptop && exec "$@"', "stop",
             sys.executable, "-m", "onceflow", "stop", "--savepoint", "sp2", ckpt2.url],
            env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        marker = markers / "fired-before_stop_savepoint-None"
        deadline = time.monotonic() + 120
        while not marker.exists() or "pid=" not in marker.read_text():
            assert time.monotonic() < deadline and stopper.poll() is None, stopper.communicate()
            time.sleep(0.2)
        time.sleep(3)  # the stop polls every 0.2 s: the lease is free and the request still there
        assert stopper.poll() is None, ("'onceflow stop' did not wait for the paused driver", stopper.communicate())
        paused = dict(kv.split("=") for kv in marker.read_text().split())
        os.killpg(int(paused["pgid"]), signal.SIGCONT)
        os.kill(int(paused["pid"]), signal.SIGCONT)
        out, err = stopper.communicate(timeout=180)
        assert stopper.returncode == 0, err
        assert f"savepoint {sp2}: job cli-counts" in out and "the driver on host" in err, (out, err)
        assert sup.wait(timeout=60) == 0
    finally:
        if sup.poll() is None:
            sup.kill()
        if (markers / "fired-before_stop_savepoint-None").exists():  # a driver left paused: gone
            paused = dict(kv.split("=") for kv in (markers / "fired-before_stop_savepoint-None").read_text().split())
            try:
                os.killpg(int(paused["pgid"]), signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert ckpt2.lineage == ckpt.lineage
    assert os.listdir(sps) == [name] and not (tmp_path / "savepoints").exists()  # only where asked
    resumed_at = json.loads(open(f"{sp2}/_savepoint.json").read())["source_offsets"][0]["next"]
    assert resumed_at > stopped_at

    # Resume from the second savepoint: the sink ends exactly as after an uninterrupted run.
    # 'onceflow run --from-savepoint SP --checkpoint C3' hands the driver exactly this
    # environment; the driver runs in-process here to reuse the test's JVM.
    ckpt3 = tmp_path / "ckpt3"
    RestoreRequest(sp2).check(str(ckpt3))  # what 'onceflow run' checks before its drivers start
    restore = restore_env(sp2, False, None, False)
    for k, v in {**env, "TOTAL": str(resumed_at + 3000), CHECKPOINT_ENV: str(ckpt3), **restore}.items():
        monkeypatch.setenv(k, v)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert driver.main([str(tmp_path / "job.py")]) == EXIT_OK
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert CheckpointDir(str(ckpt3)).lineage == ckpt.lineage
    report = check_delta_table(str(tmp_path / "table"), resumed_at + 3000)
    assert report.ok, report
    import deltalake

    rows = deltalake.DeltaTable(str(tmp_path / "table")).to_pyarrow_table(columns=["id", "running_count"])
    assert sorted(zip(rows["id"].to_pylist(), rows["running_count"].to_pylist(), strict=True)) == [
        (i, i // 16 + 1) for i in range(resumed_at + 3000)]

    # A stop whose savepoint cannot be written (its directory would be under a regular file):
    # the real driver stops, exits 4 with a one-line error, and the checkpoint stays usable.
    (tmp_path / "blocker").write_text("not a directory")
    monkeypatch.setenv(SAVEPOINT_DIR_ENV, str(tmp_path / "blocker" / "sps"))
    monkeypatch.setenv("TOTAL", str(resumed_at + 60000))
    for k in restore:
        monkeypatch.delenv(k)
    ckpt3 = CheckpointDir(str(ckpt3))
    before = ckpt3.last_committed()

    def sigterm_after_a_new_batch() -> None:
        deadline = time.monotonic() + 120
        while (ckpt3.last_committed() or 0) <= before and time.monotonic() < deadline:
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)

    capsys.readouterr()
    threading.Thread(target=sigterm_after_a_new_batch, daemon=True).start()
    try:
        assert driver.main([str(tmp_path / "job.py")]) == EXIT_SAVEPOINT_FAILED
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    err = capsys.readouterr().err
    # How each run started, as its source saw it (plans built only for a restore's checks left out).
    starts = [json.loads(x) for x in open(tmp_path / "starts.jsonl")]
    runs = [(s["start"], s["attempt"], s["savepoint"]) for s in starts if s["lineage"] is not None or s["start"] == "fresh"]
    assert runs == [("fresh", 0, None), ("restored", 0, sp), ("restored", 0, sp2), ("resumed", 0, sp2)]
    assert {s["lineage"] for s in starts if s["lineage"]} == {ckpt.lineage}
    assert "error: stopped, but the savepoint on stop failed" in err and f"the checkpoint {ckpt3.url} is intact" in err
    r = CliRunner().invoke(main, ["savepoint", "create", ckpt3.url, str(tmp_path / "sp3")])
    assert r.exit_code == 0, r.output
    stopped_at = json.loads(open(tmp_path / "sp3" / "_savepoint.json").read())["source_offsets"][0]["next"]
    assert resumed_at + 3000 < stopped_at < resumed_at + 60000
    assert check_delta_table(str(tmp_path / "table"), stopped_at).ok


def test_savepoint_cli_refusals(tmp_path):
    cli = CliRunner()
    r = cli.invoke(main, ["savepoint", "create", str(tmp_path / "nothing")])
    assert r.exit_code == 2 and "nothing does not exist" in r.output
    r = cli.invoke(main, ["savepoint", "inspect", str(tmp_path)])
    assert r.exit_code == 2 and "not a savepoint" in r.output
    r = cli.invoke(main, ["savepoint", "dispose", str(tmp_path)])
    assert r.exit_code == 2 and tmp_path.exists()
    r = cli.invoke(main, ["savepoint", "list", str(tmp_path)])
    assert r.exit_code == 0 and "no savepoints" in r.output


@pytest.mark.parametrize("args", [["stop", "{tmp}/ckpt"], ["cancel", "{tmp}/ckpt"]])
def test_stop_when_nothing_runs(tmp_path, args):
    from onceflow.checkpoint.eventlog import EventLog

    EventLog(str(tmp_path / "ckpt")).append("stop", reason="finished", exit_code=0, scope="process")
    r = CliRunner().invoke(main, [a.format(tmp=tmp_path) for a in args])
    assert r.exit_code == 0 and "not running" in r.output


def test_stop_checks_host_and_start_time_before_signalling(tmp_path):
    """'onceflow stop' never signals a pid it cannot prove is the job's supervisor."""
    import socket

    from onceflow.checkpoint.eventlog import EventLog
    from onceflow.process import start_time as process_start_time

    ckpt = str(tmp_path / "ckpt")
    me = os.getpid()  # a live process that is not a supervisor: SIGTERM would kill pytest
    events = EventLog(ckpt)
    events.append("process_start", supervisor_pid=me, host="elsewhere.example", supervisor_started=1, scope="process")
    r = CliRunner().invoke(main, ["stop", ckpt])
    assert r.exit_code == 2 and "last supervised on host elsewhere.example" in r.output and "run 'onceflow stop' there" in r.output
    events.append("process_start", supervisor_pid=me, host=socket.gethostname(),
                  supervisor_started=process_start_time(me) - 1, scope="process")  # pid reused
    r = CliRunner().invoke(main, ["stop", ckpt])
    assert r.exit_code == 0 and "not running" in r.output
    events.append("process_start", supervisor_pid=me, scope="process")  # older log: no host
    r = CliRunner().invoke(main, ["stop", ckpt])
    assert r.exit_code == 0 and "not running" in r.output
    assert not (tmp_path / "ckpt" / "_onceflow" / "stop_request.json").exists()


def test_stop_request_is_consumed_and_never_outlives_its_stop(tmp_path):
    """The driver consumes the stop request whenever it was written (also before a supervisor
    restart started this driver), and 'onceflow stop' removes a request no driver consumed
    once the job stopped (here a stand-in supervisor that just dies of the SIGTERM), so a
    later run never acts on it."""
    import socket
    import threading

    from onceflow.checkpoint.eventlog import EventLog
    from onceflow.process import start_time as process_start_time
    from onceflow.savepoint.operations import _write_request, stop_job, take_stop_request

    ckpt = str(tmp_path / "ckpt")
    request = tmp_path / "ckpt" / "_onceflow" / "stop_request.json"
    _write_request(ckpt, True, "/sp/here")
    time.sleep(0.01)  # a driver started after the request was written
    assert take_stop_request(ckpt)["target"] == "/sp/here"
    assert not request.exists() and take_stop_request(ckpt) is None  # consumed

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    threading.Thread(target=child.wait, daemon=True).start()  # reaped: gone once dead
    EventLog(ckpt).append("process_start", supervisor_pid=child.pid, host=socket.gethostname(),
                          supervisor_started=process_start_time(child.pid), scope="process")
    assert stop_job(ckpt, timeout=60, savepoint=True) == f"supervisor pid {child.pid}"
    assert child.wait(10) == -signal.SIGTERM
    assert not request.exists()
