"""The supervisor with real processes and real signals.

A small Python script stands in for the driver. It appends one JSON line per start to
``starts.jsonl`` and then acts according to ``PLAN`` (one action per start, the last one
repeats): ``ok`` exit 0; ``kill`` SIGKILL itself; ``crash`` exit 1; ``config`` exit 2;
``wait`` run until SIGTERM then exit 0; ``failstop`` run until SIGTERM then exit 4 (a stop
whose savepoint failed); ``stubborn`` ignore SIGTERM; ``orphan`` start a grandchild in its
group, then SIGKILL itself.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from onceflow.checkpoint.eventlog import EventLog
from onceflow.runtime.restart import fixed_delay, no_restart
from onceflow.runtime.supervisor import Supervisor, describe_exit

pytestmark = pytest.mark.timeout(30)

CHILD = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    here = os.path.dirname(os.path.abspath(__file__))
    starts = os.path.join(here, "starts.jsonl")
    n = sum(1 for _ in open(starts)) if os.path.exists(starts) else 0
    plan = os.environ["PLAN"].split(",")
    action = plan[min(n, len(plan) - 1)]
    def note(**kw):
        with open(starts, "a") as f:
            f.write(json.dumps(kw) + "\\n")
    note(pid=os.getpid(), pgid=os.getpgid(0), sid=os.getsid(0), action=action,
         pgid_env=os.environ.get("ONCEFLOW_DRIVER_PGID"), argv=sys.argv[1:])
    if action == "ok":
        sys.exit(0)
    if action == "crash":
        sys.exit(1)
    if action == "config":
        print("error: bad config", file=sys.stderr)
        sys.exit(2)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "orphan":
        g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open(os.path.join(here, "grandchild.pid"), "w").write(str(g.pid))
        os.kill(os.getpid(), signal.SIGKILL)
    if action in ("wait", "stubborn", "failstop"):
        def on_term(signum, frame):
            open(os.path.join(here, "sigterm"), "w").write("got SIGTERM")
            if action == "wait":
                sys.exit(0)
            if action == "failstop":
                sys.exit(4)
        signal.signal(signal.SIGTERM, on_term)
        open(os.path.join(here, "ready"), "w").write("ready")
        while True:
            time.sleep(0.05)
    """
)


@pytest.fixture
def child(tmp_path: Path) -> Path:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return script


def supervisor(tmp_path: Path, script: Path, plan: str, strategy=None, **kw) -> Supervisor:
    return Supervisor(
        "job.py",
        strategy or fixed_delay(attempts=3, delay=0.1),
        str(tmp_path / "ckpt"),
        env={**os.environ, "PLAN": plan},
        child_cmd=[sys.executable, str(script)],
        **kw,
    )


def starts(tmp_path: Path) -> list[dict]:
    path = tmp_path / "starts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def events(tmp_path: Path) -> list[dict]:
    return list(EventLog(str(tmp_path / "ckpt")).read())


def alive(pid: int) -> bool:
    """Running and not a zombie (an orphaned zombie may wait for a busy init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def wait_for(path: Path, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < end, f"{path.name} did not appear"
        time.sleep(0.02)


def test_clean_exit_runs_once_in_its_own_group(tmp_path, child):
    sup = supervisor(tmp_path, child, "ok", extra_args=["--flag"])
    assert sup.run() == 0
    (start,) = starts(tmp_path)
    assert start["pgid"] == start["pid"] == start["sid"] != os.getpgid(0)
    assert start["pgid_env"] == str(start["pgid"])
    assert start["argv"] == ["--flag"]
    kinds = [e["event"] for e in events(tmp_path)]
    assert kinds == ["process_start", "stop"]
    assert events(tmp_path)[0]["pid"] == start["pid"]
    assert events(tmp_path)[1]["reason"] == "finished"


def test_sigkilled_driver_is_restarted_per_strategy(tmp_path, child):
    t0 = time.monotonic()
    assert supervisor(tmp_path, child, "kill,kill,ok", fixed_delay(attempts=2, delay=0.3)).run() == 0
    assert time.monotonic() - t0 >= 0.6  # two delays were waited
    assert [s["action"] for s in starts(tmp_path)] == ["kill", "kill", "ok"]
    ev = events(tmp_path)
    assert [e["event"] for e in ev] == [
        "process_start", "restart", "process_start", "restart", "process_start", "stop"]
    restarts = [e for e in ev if e["event"] == "restart"]
    assert [r["attempt"] for r in restarts] == [1, 2]
    for r in restarts:
        assert r["cause"] == "killed by SIGKILL" and r["exit_code"] == -signal.SIGKILL
        assert r["delay_s"] == 0.3 and r["scope"] == "process"
        assert abs(r["crashed_at"] - r["ts"]) < 1
    assert [e["attempt"] for e in ev if e["event"] == "process_start"] == [1, 2, 3]


def test_gives_up_when_the_strategy_says_so(tmp_path, child):
    assert supervisor(tmp_path, child, "crash", fixed_delay(attempts=2, delay=0)).run() == 3
    assert len(starts(tmp_path)) == 3
    ev = events(tmp_path)
    assert [e["event"] for e in ev].count("restart") == 2
    assert ev[-1]["event"] == "gave_up" and ev[-1]["cause"] == "exited with code 1"


def test_no_restart_strategy_gives_up_on_the_first_crash(tmp_path, child):
    assert supervisor(tmp_path, child, "kill", no_restart()).run() == 3
    assert len(starts(tmp_path)) == 1
    assert events(tmp_path)[-1]["event"] == "gave_up"


def test_config_error_is_not_restarted(tmp_path, child):
    assert supervisor(tmp_path, child, "config").run() == 2
    assert len(starts(tmp_path)) == 1
    ev = events(tmp_path)
    assert [e["event"] for e in ev] == ["process_start", "stop"] and ev[-1]["reason"] == "config_error"


def test_real_driver_config_error_is_not_restarted(tmp_path, capfd):
    sup = Supervisor(str(tmp_path / "missing_job.py"), fixed_delay(attempts=3, delay=0),
                     str(tmp_path / "ckpt"))
    assert sup.run() == 2
    assert [e["event"] for e in events(tmp_path)] == ["process_start", "stop"]
    assert "missing_job.py" in capfd.readouterr().err


def test_leftover_grandchildren_are_killed_before_the_restart(tmp_path, child):
    assert supervisor(tmp_path, child, "orphan,ok").run() == 0
    grandchild = int((tmp_path / "grandchild.pid").read_text())
    assert not alive(grandchild)
    assert [s["action"] for s in starts(tmp_path)] == ["orphan", "ok"]


def _spawn_supervisor(tmp_path: Path, script: Path, plan: str, stop_timeout: float) -> subprocess.Popen:
    code = textwrap.dedent(
        f"""
        import logging, sys
        from onceflow.runtime.restart import fixed_delay
        from onceflow.runtime.supervisor import Supervisor
        logging.basicConfig(level=logging.INFO)
        sys.exit(Supervisor("job.py", fixed_delay(3, 0), {str(tmp_path / "ckpt")!r},
                            child_cmd=[sys.executable, {str(script)!r}],
                            stop_timeout={stop_timeout}).run())
        """
    )
    return subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PLAN": plan},
                            stderr=subprocess.PIPE, text=True)


def test_sigterm_to_supervisor_stops_the_driver_gracefully(tmp_path, child):
    sup = _spawn_supervisor(tmp_path, child, "wait", stop_timeout=20)
    wait_for(tmp_path / "ready")
    sup.send_signal(signal.SIGTERM)
    _, err = sup.communicate(timeout=20)
    assert sup.returncode == 0, err
    assert (tmp_path / "sigterm").read_text() == "got SIGTERM"
    assert not alive(starts(tmp_path)[0]["pid"])
    ev = events(tmp_path)
    assert [e["event"] for e in ev] == ["process_start", "stop"]
    assert ev[-1]["signal"] == "SIGTERM" and ev[-1]["exit_code"] == 0 and not ev[-1]["forced"]
    # What 'onceflow stop' checks before signalling: this host, this supervisor's start time.
    assert ev[0]["host"] == socket.gethostname() and ev[0]["supervisor_pid"] == sup.pid
    assert isinstance(ev[0]["supervisor_started"], int)  # clock ticks since boot


def test_a_failed_stop_is_the_supervisors_exit_code(tmp_path, child):
    sup = _spawn_supervisor(tmp_path, child, "failstop", stop_timeout=20)
    wait_for(tmp_path / "ready")
    sup.send_signal(signal.SIGTERM)
    _, err = sup.communicate(timeout=20)
    assert sup.returncode == 4, err  # not 0: the stop (e.g. its savepoint) failed
    assert events(tmp_path)[-1]["exit_code"] == 4 and "exited with code 4 while stopping" in err


def test_driver_ignoring_sigterm_is_killed_after_the_stop_timeout(tmp_path, child):
    sup = _spawn_supervisor(tmp_path, child, "stubborn", stop_timeout=0.5)
    wait_for(tmp_path / "ready")
    t0 = time.monotonic()
    sup.send_signal(signal.SIGINT)
    _, err = sup.communicate(timeout=20)
    assert sup.returncode == 128 + signal.SIGKILL, err  # a stop that had to kill is no clean stop
    assert time.monotonic() - t0 >= 0.5
    assert (tmp_path / "sigterm").exists()  # it was asked first
    assert events(tmp_path)[-1]["exit_code"] == -signal.SIGKILL
    assert "not stopped after 0.5s" in err


def test_describe_exit():
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(1) == "exited with code 1"


def test_overrides_reach_the_job_through_the_environment(tmp_path):
    from onceflow.job import CheckpointConfig, Job
    from onceflow.runtime.launch import CHECKPOINT_ENV, RESTART_STRATEGY_ENV, apply_overrides
    from onceflow.runtime.restart import NoRestart

    job = Job("j", source=lambda spark: None, sink=object(), checkpoint=CheckpointConfig(str(tmp_path)))
    apply_overrides(job, {CHECKPOINT_ENV: str(tmp_path / "other"), RESTART_STRATEGY_ENV: "none"})
    assert job.checkpoint.directory == str(tmp_path / "other")
    assert isinstance(job.restart_strategy, NoRestart)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "{tmp}/job.py"], "defines no onceflow.Job"),
        (["run", "{tmp}/job.py", "--restart-strategy", "sometimes"], "unknown restart strategy 'sometimes'"),
        (["run", "{tmp}/missing.py"], "not found"),
    ],
)
def test_cli_run_reports_config_errors_in_one_line(tmp_path, args, message):
    from click.testing import CliRunner

    from onceflow.cli.main import main

    (tmp_path / "job.py").write_text("x = 1\n")
    result = CliRunner().invoke(main, [a.format(tmp=tmp_path) for a in args])
    assert result.exit_code == 2
    assert result.output.startswith("error: ") and message in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_second_sigint_kills_at_once(tmp_path, child):
    sup = _spawn_supervisor(tmp_path, child, "stubborn", stop_timeout=60)
    wait_for(tmp_path / "ready")
    sup.send_signal(signal.SIGINT)
    wait_for(tmp_path / "sigterm")  # forwarded, and ignored by the driver
    t0 = time.monotonic()
    sup.send_signal(signal.SIGINT)
    _, err = sup.communicate(timeout=20)
    assert sup.returncode == 130, err
    assert time.monotonic() - t0 < 5
    assert not alive(starts(tmp_path)[0]["pid"])
    assert events(tmp_path)[-1]["forced"] is True


def test_cli_group_turns_onceflow_errors_into_one_line(tmp_path):
    import click
    from click.testing import CliRunner

    from onceflow.cli.main import _Main
    from onceflow.errors import CheckpointError

    def boom() -> None:
        raise CheckpointError("checkpoint /x is corrupt; restore it from a savepoint")

    group = _Main(commands=[click.Command("boom", callback=boom)])
    result = CliRunner().invoke(group, ["boom"])
    assert result.exit_code == 2
    assert result.output == "error: checkpoint /x is corrupt; restore it from a savepoint\n"


STANDBY_CHILD = textwrap.dedent(
    """
    import json, os, signal, sys, time
    here = os.path.dirname(os.path.abspath(__file__))
    go = os.environ.get("ONCEFLOW_STANDBY_GO")
    def note(role):
        with open(os.path.join(here, "roles.jsonl"), "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "role": role, "ts": time.time()}) + "\\n")
    signal.signal(signal.SIGTERM, lambda *a: (note("stopped"), sys.exit(0)))
    if go:
        note("standby")
        open(go + ".ready", "w").write("pid=%d warm_s=0.1" % os.getpid())
        while not os.path.exists(go):
            time.sleep(0.02)
    note("active")
    while True:
        time.sleep(0.05)
    """
)


def roles(tmp_path: Path) -> list[dict]:
    path = tmp_path / "roles.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_until(cond, timeout: float = 10.0):
    end = time.monotonic() + timeout
    while not (found := cond()):
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)
    return found


def test_a_warm_standby_is_promoted_at_once_replaced_and_stopped_with_the_driver(tmp_path):
    """The active driver SIGKILLed: the waiting standby becomes active within a second (no
    new process start) and a new standby is started; a standby that dies is replaced;
    SIGTERM stops the pair and leaves no process behind."""
    import threading

    script = tmp_path / "child.py"
    script.write_text(STANDBY_CHILD)
    sup = Supervisor("job.py", fixed_delay(attempts=3, delay=0), str(tmp_path / "ckpt"),
                     child_cmd=[sys.executable, str(script)], standby=True, standby_delay=0.2)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(sup.run()))
    thread.start()
    try:
        def by(role):
            return [r["pid"] for r in roles(tmp_path) if r["role"] == role]
        first_active = wait_until(lambda: by("active"))[0]
        standby = wait_until(lambda: by("standby"))[0]
        wait_until(lambda: any(e["event"] == "standby_ready" for e in events(tmp_path)))
        killed_at = time.time()
        os.kill(first_active, signal.SIGKILL)
        promoted = wait_until(lambda: [r for r in roles(tmp_path) if r["role"] == "active" and r["pid"] == standby])
        assert promoted[0]["ts"] - killed_at < 1.0, "the standby takes over at once"
        second = wait_until(lambda: [p for p in by("standby") if p != standby])[0]
        os.kill(second, signal.SIGKILL)  # a standby that dies is replaced
        third = wait_until(lambda: [p for p in by("standby") if p not in (standby, second)])[0]
        start = [e for e in events(tmp_path) if e["event"] == "process_start"]
        assert [s["pid"] for s in start] == [first_active, standby] and start[1]["standby"] is True
        assert [e["pid"] for e in events(tmp_path) if e["event"] == "standby_exit"] == [second]
    finally:
        sup._on_signal(signal.SIGTERM, None)
        thread.join(30)
    assert result == [0]
    assert not alive(standby) and not alive(third)
    assert {r["pid"] for r in roles(tmp_path) if r["role"] == "stopped"} == {standby, third}
