"""The supervised driver process: ``python -m onceflow.runtime.driver path/to/job.py[:name]
[-- JOB ARGS...]`` (the job file sees ``sys.argv == [path, *JOB ARGS]``, as under spark-submit).

Exit codes (read by the supervisor): 0 finished or stopped on request; 2 configuration or
user error (do not restart); 3 the in-process restart strategy gave up (do not restart);
4 stopped on request but the savepoint could not be taken; 5 fenced: a newer driver took over
this lineage (not restarted while it holds the lease); 70 the Spark JVM died under this live
Python process (a watchdog notices within a second; restarted like any crash); anything
else, or death by a signal, is a crash (restart per strategy).

With ``ONCEFLOW_STANDBY_GO=FILE`` the process is a warm standby (see
:mod:`onceflow.runtime.standby`): it warms up, waits for FILE, then takes over the lease.

SIGTERM/SIGINT stop with a savepoint (the supervisor's contract): the in-flight batch finishes (or,
if it was only planned, is left to be replayed), the query stops, the lease is released,
then a savepoint of the last committed batch is taken (see
:func:`onceflow.savepoint.operations.savepoint_on_stop` for where it goes and how
``onceflow stop`` / ``onceflow run --no-savepoint-on-stop`` change that); its path is printed
and logged as a ``savepoint`` event with ``reason="stop"``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

from onceflow import logs
from onceflow.errors import (
    EXIT_CONFIG,
    EXIT_CRASHED,
    EXIT_FENCED,
    EXIT_GAVE_UP,
    EXIT_JVM_DIED,
    EXIT_OK,
    EXIT_SAVEPOINT_FAILED,
    FencedError,
    GaveUp,
    JvmDied,
    OnceflowError,
)
from onceflow.faults import maybe_crash
from onceflow.runtime import scratch
from onceflow.runtime.launch import (
    apply_overrides,
    restore_from_env,
    run_in_process,
    split_driver_argv,
)
from onceflow.runtime.loader import load_job
from onceflow.runtime.metrics import PORT_ENV, serve
from onceflow.runtime.runner import driver_spark
from onceflow.runtime.standby import GO_ENV, keep_warm, mark_ready, takes_over, wait_for_go, warm_up
from onceflow.savepoint.operations import savepoint_on_stop, stop_requested
from onceflow.settings import setting


def watch_jvm(interval: float = 0.5) -> threading.Thread:
    """Exit the process (code 70) as soon as the Spark JVM it launched has died.

    A driver whose JVM was killed (the OOM killer picks the biggest process: the JVM) would
    otherwise retry py4j calls forever while the supervisor sees a live process."""
    def run() -> None:
        from pyspark import SparkContext

        while True:
            time.sleep(interval)
            sc = SparkContext._active_spark_context
            proc = getattr(getattr(sc, "_gateway", None), "proc", None) if sc else None
            if proc is not None and proc.poll() is not None:
                logs.error_line(f"the Spark JVM (pid {proc.pid}) exited with code {proc.returncode} "
                                "under this driver; exiting as crashed so the supervisor restarts it")
                os._exit(EXIT_JVM_DIED)

    thread = threading.Thread(target=run, name="onceflow-jvm-watchdog", daemon=True)
    thread.start()
    return thread


def watch_stop_request(checkpoint_url: str, stop: threading.Event, waiting: list[bool],
                       done: threading.Event, poll_s: float = 1.0) -> threading.Thread:
    """Set ``stop`` once ``onceflow stop`` (run on any host) left a request in the checkpoint.

    A waiting standby ignores it (it is not running the job); the request stays for the
    driver that runs it, which consumes it when it stops (savepoint or not, as requested)."""
    log = logging.getLogger("onceflow.driver")

    def run() -> None:
        while not stop.wait(poll_s) and not done.is_set():
            if waiting[0]:
                continue
            try:
                if stop_requested(checkpoint_url):
                    log.info("stop requested in %s: stopping after the in-flight batch", checkpoint_url)
                    stop.set()
            except Exception as e:  # noqa: BLE001 - an unreachable checkpoint: try again next time
                log.debug("could not read the stop request: %s", e)

    thread = threading.Thread(target=run, name="onceflow-stop-request", daemon=True)
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> int:
    done = threading.Event()  # ends the stop-request watcher when the driver returns (in-process use)
    try:
        return _main(sys.argv[1:] if argv is None else argv, done)
    finally:
        done.set()


def _main(argv: list[str], done: threading.Event) -> int:
    parsed = split_driver_argv(argv)
    if parsed is None:
        print("usage: python -m onceflow.runtime.driver path/to/job.py[:name] [-- JOB ARGS...]",
              file=sys.stderr)
        return EXIT_CONFIG
    target, job_args = parsed
    logs.configure("standby" if os.environ.get(GO_ENV) else "driver")
    stop = threading.Event()
    waiting_standby = [bool(os.environ.get(GO_ENV))]  # not promoted yet: nothing to finish

    def _on_signal(signum, _frame):
        if waiting_standby[0]:
            os._exit(EXIT_OK)  # its JVM dies with the process group (the supervisor kills it)
        logging.getLogger("onceflow.driver").info(
            "%s received: stopping after the in-flight batch", signal.Signals(signum).name
        )
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    started = time.time()
    watch_jvm()
    try:
        job = apply_overrides(load_job(target, job_args))
        logs.set_job(job.name)
        watch_stop_request(job.checkpoint.directory, stop, waiting_standby, done)
        go = os.environ.get(GO_ENV)
        if go:  # a warm standby: ready now, running only once promoted
            spark = _standby(job, go, stop)
            if spark is None:
                return EXIT_OK
            waiting_standby[0] = False
            logs.configure("driver")  # promoted: from now on it is the active driver
            _serve_metrics(job, started)
            ran = run_in_process(job, spark, stop, restore=restore_from_env(), takeover=takes_over(go))
        else:
            _serve_metrics(job, started)
            ran = run_in_process(job, stop=stop, restore=restore_from_env())
    except GaveUp as e:
        logs.error_line(str(e))
        return EXIT_GAVE_UP
    except FencedError as e:
        logs.error_line(str(e), prefix="fenced")
        return EXIT_FENCED
    except JvmDied as e:
        logs.error_line(str(e))
        return EXIT_JVM_DIED
    except OnceflowError as e:
        logs.error_line(str(e))
        return EXIT_CONFIG if e.fatal else EXIT_CRASHED
    if stop.is_set() and ran:  # a driver that only stood by has nothing to save
        return _savepoint_on_stop(job.checkpoint.directory, job.name, started)
    return EXIT_OK


def _serve_metrics(job, started: float) -> None:
    """``onceflow run --metrics-port N``: serve Prometheus metrics while this driver is active."""
    port = os.environ.get(PORT_ENV)
    if not port:
        return
    try:
        serve(int(port), job.checkpoint.directory, job.name, started)
        logging.getLogger("onceflow.driver").info("metrics at http://0.0.0.0:%s/metrics", port)
    except OSError as e:  # e.g. a paused predecessor still holds the port: run on, say so
        logging.getLogger("onceflow.driver").warning(
            "metrics port %s: %s; this driver runs without its metrics endpoint", port, e)


def _standby(job, go: str, stop: threading.Event):
    """Warm up, then wait for the go file: the warm SparkSession, or None when stopped first."""
    log = logging.getLogger("onceflow.driver")
    spark = driver_spark(job, job.checkpoint.directory)
    scratch_dir = scratch.driver_dir(job.name, job.checkpoint.directory)
    warm = setting("ONCEFLOW_STANDBY_WARM_UP", "1").lower() not in ("0", "false", "off", "no")
    warm_s = warm_up(spark, job, go, scratch_dir) if warm else 0.0
    mark_ready(go, warm_s)
    log.info("standby ready (warm-up %s); waiting for %s", f"{warm_s:.1f} s" if warm else "off", go)
    if not wait_for_go(go, stop, warm=(lambda: keep_warm(spark, job, go, scratch_dir)) if warm else None):
        return None
    log.info("standby promoted: taking over the lease of %s", job.checkpoint.directory)
    return spark


def _savepoint_on_stop(checkpoint_url: str, job_name: str, started: float) -> int:
    maybe_crash("before_stop_savepoint", -1)
    try:
        taken = savepoint_on_stop(checkpoint_url, job_name, started)
    except Exception as e:  # noqa: BLE001 - any failure: the stop did not do what was asked
        logs.error_line(f"stopped, but the savepoint on stop failed: {e}; the checkpoint "
                        f"{checkpoint_url} is intact: take one with 'onceflow savepoint create "
                        f"{checkpoint_url}'")
        return EXIT_SAVEPOINT_FAILED
    if taken:
        url, m = taken
        logging.getLogger("onceflow.driver").info("savepoint on stop: %s (batch %d)", url, m.batch)
        print(f"savepoint {url}: job {m.job}, batch {m.batch}, {len(m.files)} files", flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
