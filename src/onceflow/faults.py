"""Deterministic fault injection for crash tests.

Set ``ONCEFLOW_CRASH_AT`` (or the sink option ``test_crash_at``) to ``point[@batch][:mode]`` (comma-separated for several):
``point`` is one of :data:`POINTS`; ``batch`` limits it to one batch id; ``mode`` is
``kill`` (SIGKILL the whole driver process group: a machine crash; only for drivers started
in their own session, as ``onceflow run`` does), ``pause`` (SIGSTOP that same group and the
firing process: a GC pause, VM freeze or partition; the firing thread does not return
before its process's stop has begun; the marker file names the process group and pid to
SIGCONT), ``kill_executor`` (tasks only, on a cluster:
SIGKILL the executor JVM running the task - an executor lost at that point) or ``raise`` (the
task or commit raises: an executor/task failure).
A point fires at most once per ``ONCEFLOW_CRASH_MARKER_DIR`` (a marker file records it),
so the restarted driver gets past it. Unset in production; costs one dict lookup.

``ONCEFLOW_SLOW_COMMIT_FILE`` names a file; while it exists, every batch commit first sleeps
the number of seconds it holds (a slow sink, injected by ``onceflow verify``).
"""

from __future__ import annotations

import os
import signal
import time

from onceflow.errors import InjectedCrash
from onceflow.process import executor_jvm
from onceflow.settings import setting

POINTS = (
    "before_precommit",  # task: before writing anything
    "after_precommit",  # task: after its transaction is durable but before returning
    "after_decision_lookup",  # driver: looked up batch N's decision (none), nothing decided
    "before_decide",  # driver: all tasks pre-committed, nothing decided yet
    "after_decide",  # driver: decision durable, nothing visible yet
    "after_catalog_commit",  # driver (Iceberg): the catalog took the batch's snapshot, its reply
    # is lost (raise: the commit fails as if the reply never came; kill: the driver dies)
    "mid_commit",  # driver: some handles visible
    "after_commit",  # driver: batch visible, Spark has not written commits/N
    "before_stop_savepoint",  # driver: stopped, lease released, the stop request not acted on yet
)

MODES = ("kill", "kill_executor", "raise", "pause")


def _rules(spec: str) -> list[tuple[str, int | None, str]]:
    rules = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        mode = "kill"
        if ":" in item:
            item, mode = item.split(":", 1)
        batch = None
        if "@" in item:
            item, b = item.split("@", 1)
            batch = int(b)
        if item not in POINTS:
            raise ValueError(f"ONCEFLOW_CRASH_AT: unknown point {item!r}; known: {', '.join(POINTS)}")
        if mode not in MODES:
            raise ValueError(f"ONCEFLOW_CRASH_AT: unknown mode {mode!r}; known: {', '.join(MODES)}")
        rules.append((item, batch, mode))
    return rules


def maybe_crash(
    point: str, batch_id: int, partition: int | None = None, options: dict | None = None
) -> None:
    """Crash here if a rule matches (once per marker dir).

    Rules come from the environment or, for in-process tests whose Spark workers were started
    earlier, from the sink options ``test_crash_at`` / ``test_crash_markers``; the option
    ``test_crash_at=none`` turns the environment's rules off for one query.
    """
    spec = (options or {}).get("test_crash_at") or setting("ONCEFLOW_CRASH_AT")
    if not spec or spec == "none":  # "none": a query that must never fire (a standby's warm-up)
        return
    marker_dir = (options or {}).get("test_crash_markers") or setting("ONCEFLOW_CRASH_MARKER_DIR")
    for name, batch, mode in _rules(spec):
        if name != point or (batch is not None and batch != batch_id):
            continue
        # PySpark's worker daemon puts workers in their own process group, so target the
        # driver's group: named by the supervisor, else the session leader (the driver was
        # started with start_new_session, so its pid is both the session and group id).
        # The process that fires may itself be outside that group (the streaming commit
        # runner is forked by the worker daemon): it is stopped or killed too.
        pgid = int(setting("ONCEFLOW_DRIVER_PGID", "0")) or os.getsid(0)
        if marker_dir:
            marker = os.path.join(marker_dir, f"fired-{name}-{batch}")
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                continue
            os.write(fd, f"batch={batch_id} partition={partition} pgid={pgid} pid={os.getpid()}\n".encode())
            os.close(fd)
        if mode == "pause":
            # One stop signal per process: a second SIGSTOP to this process, sent after the
            # group's, would only act after the first SIGCONT and could outlast a resumer
            # that signals the group and then the pid (a zombie left stopped forever).
            os.killpg(pgid, signal.SIGSTOP)
            if os.getpgid(0) != pgid:
                os.kill(os.getpid(), signal.SIGSTOP)
            _until_stopping()  # this thread stops here, not a few steps on
            return  # resumed by SIGCONT: carry on as a zombie would
        if mode == "raise":
            raise InjectedCrash(f"injected crash at {point} (batch {batch_id}, partition {partition})")
        if mode == "kill_executor":
            executor = executor_jvm()
            if executor is None:
                raise InjectedCrash(f"{point}:kill_executor fired outside an executor JVM (use local-cluster)")
            os.kill(executor, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        os.killpg(pgid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_slow() -> None:
    """Sleep before deciding a batch while the slow-commit file exists (see module doc)."""
    path = setting("ONCEFLOW_SLOW_COMMIT_FILE")
    if not path:
        return
    try:
        with open(path) as f:
            delay = float(f.read().strip() or 0)
    except (OSError, ValueError):
        return
    time.sleep(max(0.0, delay))


def _until_stopping(timeout_s: float = 10.0) -> None:
    """Return once this process's stop has begun for every thread (or it already resumed).

    A SIGSTOP sent to a process is taken by one thread (the kernel prefers the main one),
    which then makes every other thread stop too. Until that thread gets a CPU, the one that
    fired runs on: on a loaded machine it finished a whole decide before it stopped. While
    SIGSTOP waits in the process's shared queue (``ShdPnd`` of /proc/self/status) the stop
    has not begun; once it has left it, this thread's stop is pending and happens on the way
    back from the read that saw it."""
    bit = 1 << (signal.SIGSTOP - 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open("/proc/self/status") as f:
                shared = next((int(ln.split()[1], 16) for ln in f if ln.startswith("ShdPnd:")), 0)
        except OSError:  # no /proc: give the stop a moment
            time.sleep(0.05)
            return
        if not shared & bit:
            return
        time.sleep(0.0005)
