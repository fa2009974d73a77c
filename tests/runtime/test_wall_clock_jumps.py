"""The runner's idle and batch timers run on the monotonic clock: a wall clock that jumps by
minutes (NTP step, VM resume, a skewed host) neither ends a job as "idle" nor times out a batch,
and a step back does not stall the job for the step's length.

Found while building ``onceflow verify``'s clock_skew fault, by reading the runner (no verify
run has shown it yet): ``stop_when_idle`` and ``batch_timeout_s`` compared ``time.time()``
readings, so a forward jump of 300 s during a moment without data made the job stop as if its
source were exhausted (exit 0, the rest of the stream never read), and one during a batch
timed the batch out.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest

from onceflow.checkpoint.eventlog import EventLog
from onceflow.runtime import runner as runner_mod
from onceflow.runtime.runner import JobRunner
from onceflow.verify import procs
from onceflow.verify.clock import clock_shim, libfaketime, set_offset


class _IdleQuery:
    """A streaming query between two triggers: no batch ran, the source reports no data."""

    def __init__(self):
        self.stopped = threading.Event()
        self.status = {"isTriggerActive": False, "isDataAvailable": False}
        self.recentProgress: list = []
        self.lastProgress = object()

    def awaitTermination(self, timeout: float) -> bool:
        return self.stopped.wait(timeout)

    def exception(self):
        return None

    def stop(self) -> None:
        self.stopped.set()


class _Clock:
    """``time`` with a wall clock that jumps ``offset`` seconds; monotonic clocks stay real."""

    def __init__(self):
        self.offset = 0.0

    def module(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(time=lambda: time.time() + self.offset, monotonic=time.monotonic,
                                     sleep=time.sleep, perf_counter=time.perf_counter)


def _runner(idle_s: float, batch_timeout_s: float | None) -> JobRunner:
    r = JobRunner.__new__(JobRunner)
    r.job = types.SimpleNamespace(name="j", stop_when_idle=idle_s,
                                  checkpoint=types.SimpleNamespace(batch_timeout_s=batch_timeout_s,
                                                                   interval_s=1.0))
    r.stop = threading.Event()
    r.events = types.SimpleNamespace(append=lambda *a, **k: None)
    return r


def test_a_wall_clock_jump_does_not_end_a_job_as_idle(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(runner_mod, "time", clock.module())
    r, query = _runner(idle_s=60.0, batch_timeout_s=None), _IdleQuery()
    errors: list[BaseException] = []

    def monitor() -> None:
        try:
            r._monitor(query, time.time())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=monitor, daemon=True)
    t.start()
    time.sleep(0.8)  # idle since the first poll
    clock.offset = 300.0  # the host's clock steps 5 minutes ahead
    time.sleep(1.5)
    assert not query.stopped.is_set(), "the job was stopped as idle after 2 s of a 60 s idle timeout"
    r.stop.set()  # a requested stop still ends it
    t.join(5)
    assert query.stopped.is_set() and not t.is_alive() and not errors


def test_a_wall_clock_jump_does_not_time_out_a_running_batch(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(runner_mod, "time", clock.module())
    r, query = _runner(idle_s=60.0, batch_timeout_s=120.0), _IdleQuery()
    query.status = {"isTriggerActive": True, "isDataAvailable": True}  # a batch is running
    errors: list[BaseException] = []

    def monitor() -> None:
        try:
            r._monitor(query, time.time())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=monitor, daemon=True)
    t.start()
    time.sleep(0.8)
    clock.offset = 300.0
    time.sleep(1.5)
    assert not errors and not query.stopped.is_set(), f"the batch was timed out after 2 s: {errors}"
    query.status = {"isTriggerActive": False, "isDataAvailable": False}
    r.stop.set()
    t.join(5)
    assert query.stopped.is_set() and not errors


JOB = textwrap.dedent(
    """
    import os
    import sys
    from onceflow import CheckpointConfig, DeltaSink, Job, no_restart

    if getattr(sys.modules["__main__"].__spec__, "name", "") == "onceflow.runtime.driver":
        # the JVM this driver starts (and the JVM's Python workers) run on a libfaketime clock;
        # the driver process itself keeps the real one (a preload acts from the next exec)
        from onceflow.verify.clock import faketime_env
        os.environ.update(faketime_env(os.environ["JVM_FAKETIME"]))

    def source(spark):
        return (spark.readStream.format("onceflow-sequence").option("total", 10**9)
                .option("rows_per_second", 200).option("max_rows_per_batch", 400).load())

    job = Job(name="clock", source=source, sink=DeltaSink(os.environ["WORK"] + "/table"),
              checkpoint=CheckpointConfig(os.environ["WORK"] + "/ckpt", interval="1 s"),
              restart_strategy=no_restart(), master="local[1]",
              spark_conf={"spark.sql.shuffle.partitions": "1"})
    """
)


def _commits(work) -> list[dict]:
    return [e for e in EventLog(str(work / "ckpt")).read() if e["event"] == "sink_commit" and e["rows"]]


@pytest.mark.skipif(libfaketime() is None or shutil.which("cc") is None,
                    reason="needs libfaketime (apt-get install faketime) and a C compiler")
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_wall_clock_step_back_does_not_stall_the_job(tmp_path):
    """Spark's processing-time trigger waits for a wall-clock instant: after the host clock
    stepped back 120 s, the query waited 120 s before its next batch (found by ``onceflow verify
    --faults clock_skew`` in CI: no batch committed for the whole 15 s skew). The runner
    restarts the query when the clock its trigger waits on (the JVM's) stepped back: batches go
    on within seconds.

    Only the JVM's clock steps here; the driver's Python process keeps the real one. Before,
    the runner judged the step by its own process's clock: under libfaketime, which re-reads
    each process's clock file on that process's own schedule, it restarted the query before the
    JVM's clock had stepped, the new query's trigger stalled for the whole step all the same,
    and in ``onceflow verify`` the job then ended "idle" and released its lease to the
    standing-by successor (CI, stop 37). Now the runner reads the clock the trigger waits on:
    the JVM's."""
    (tmp_path / "job.py").write_text(JOB)
    clock_shim(str(tmp_path))
    jvm_clock = str(tmp_path / "faketime-jvm")
    set_offset(jvm_clock, 0)
    env = {**os.environ, "WORK": str(tmp_path), "JVM_FAKETIME": jvm_clock}
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "onceflow", "run", "--no-standby", str(tmp_path / "job.py")],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while len(_commits(tmp_path)) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        set_offset(jvm_clock, -120)  # the JVM's clock steps back two minutes and stays there
        stepped, before = time.monotonic(), len(_commits(tmp_path))
        time.sleep(2.5)  # (libfaketime re-reads a clock file at most each second)
        seen = len(_commits(tmp_path))
        while len(_commits(tmp_path)) < seen + 3 and time.monotonic() - stepped < 60:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.3)
        waited = time.monotonic() - stepped
        assert len(_commits(tmp_path)) >= seen + 3, (
            f"3 batches took longer than {waited:.0f} s after the clock stepped back 120 s "
            f"({before} committed before the step)\n" + log.read_text()[-2000:])
        assert waited < 30, f"3 batches took {waited:.0f} s after the step"
        steps = [e for e in EventLog(str(tmp_path / "ckpt")).read() if e["event"] == "clock_step"]
        assert steps and steps[0]["back_s"] >= 100, steps
        assert "wall clock stepped back" in log.read_text()
    finally:  # the supervisor, and the driver in its own process group with its JVM
        procs.signal_all([*procs.tree(proc.pid), *procs.with_env("WORK", str(tmp_path))], signal.SIGKILL)
        proc.wait(timeout=30)
