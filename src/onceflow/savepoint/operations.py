"""Savepoint operations besides create and restore: list, inspect, dispose, stop-with-savepoint."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass, field

from onceflow.checkpoint.eventlog import EVENTS_DIR, EventLog
from onceflow.checkpoint.layout import CheckpointDir
from onceflow.process import start_time
from onceflow.savepoint.create import (
    create_savepoint,
    default_savepoint_dir,
    default_target,
    live_lease_holder,
)
from onceflow.savepoint.manifest import (
    MANIFEST,
    Manifest,
    SavepointError,
    is_savepoint,
    read_manifest,
)
from onceflow.savepoint.transfer import sha256_of
from onceflow.storage import url_to_fs, write_whole

log = logging.getLogger("onceflow.savepoint")


def list_savepoints(url: str = ".") -> list[tuple[str, Manifest | SavepointError]]:
    """Savepoints at ``url``: the savepoint itself, the ones in a directory, or for a
    checkpoint directory the ones in its default place (``../savepoints``). Oldest first."""
    url = url.rstrip("/") or "."
    if is_savepoint(url):
        return [(url, read_manifest(url))]
    if CheckpointDir(url).exists():
        url = default_target(url, 0).rsplit("/", 1)[0]
    fs, path = url_to_fs(url)
    try:
        children = [p.rstrip("/") for p in fs.ls(path, detail=False)]
    except FileNotFoundError:
        return []
    found: list[tuple[str, Manifest | SavepointError]] = []
    for child in sorted(children):
        if not fs.exists(f"{child}/{MANIFEST}"):
            continue
        child_url = f"{url}/{child.rsplit('/', 1)[-1]}"
        try:
            found.append((child_url, read_manifest(child_url)))
        except SavepointError as e:
            found.append((child_url, e))
    return sorted(found, key=lambda x: x[1].created if isinstance(x[1], Manifest) else 0)


@dataclass
class Inspection:
    url: str
    manifest: Manifest
    verified: bool | None = None  # None: not checked
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def inspect_savepoint(url: str, verify: bool = True) -> Inspection:
    """The manifest, and with ``verify`` every file's presence, size and SHA-256."""
    url = url.rstrip("/")
    manifest = read_manifest(url)
    result = Inspection(url, manifest)
    if not verify:
        return result
    fs, root = url_to_fs(url)
    for f in manifest.files:
        path = f"{root}/{f.path}"
        try:
            size, digest = sha256_of(fs, path)
        except FileNotFoundError:
            result.problems.append(f"{f.path}: missing")
            continue
        if size != f.size:
            result.problems.append(f"{f.path}: {size} bytes, manifest says {f.size}")
        elif digest != f.sha256:
            result.problems.append(f"{f.path}: SHA-256 mismatch")
    result.verified = not result.problems
    return result


def dispose_savepoint(url: str) -> Manifest:
    """Delete a savepoint (only a directory with a readable ``_savepoint.json``)."""
    url = url.rstrip("/")
    manifest = read_manifest(url)
    fs, root = url_to_fs(url)
    if fs.exists(f"{root}/metadata"):
        raise SavepointError(f"{url} looks like a live checkpoint directory, not a savepoint; not deleting it")
    fs.rm(root, recursive=True)
    log.info("disposed savepoint %s (batch %d of job %s)", url, manifest.batch, manifest.job)
    return manifest


# ---- stop with savepoint ------------------------------------------------------------------

#: ``onceflow run --no-savepoint-on-stop`` / ``--savepoint-dir DIR`` -> the driver.
SAVEPOINT_ON_STOP_ENV = "ONCEFLOW_SAVEPOINT_ON_STOP"
SAVEPOINT_DIR_ENV = "ONCEFLOW_SAVEPOINT_DIR"
#: written by ``onceflow stop [--savepoint [TARGET]]`` before it signals: what the stop should do
STOP_REQUEST = f"{EVENTS_DIR}/stop_request.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _supervisor(events: list[dict]) -> tuple[dict | None, float]:
    """(latest ``process_start`` not followed by a process ``stop``, its ts)."""
    start, ts = None, 0.0
    for e in events:
        if e.get("event") == "process_start":
            start, ts = e, float(e.get("ts", 0))
        elif e.get("event") in ("stop", "gave_up") and e.get("scope") == "process":
            start = None
    return start, ts


def _live_supervisor(url: str, start: dict | None) -> int | None:
    """The supervisor pid of ``start`` if that very process is alive on this host.

    None when it runs on another host (see :func:`stop_job`), or when its pid is gone or reused
    by a process that started at another time than the one recorded."""
    if not start or not start.get("supervisor_pid"):
        return None
    pid, host = int(start["supervisor_pid"]), start.get("host")
    if host is None:
        log.warning("the event log of %s does not record the supervisor's host (older onceflow); "
                    "not signalling pid %d", url, pid)
        return None
    if host != socket.gethostname() or not _alive(pid):
        return None
    recorded, now = start.get("supervisor_started"), start_time(pid)
    if recorded is not None and now is not None and int(recorded) != now:
        log.info("pid %d of the recorded supervisor now belongs to another process; not signalling", pid)
        return None
    return pid


def _write_request(url: str, savepoint: bool, target: str | None, immediate: bool = False) -> str:
    """Leave the stop request for the driver; returns its id."""
    fs, path = url_to_fs(f"{url}/{STOP_REQUEST}")
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    rid = uuid.uuid4().hex
    write_whole(fs, path, json.dumps({"id": rid, "ts": round(time.time(), 3), "savepoint": savepoint,
                                      "target": target, "immediate": immediate}).encode())
    return rid


def _read_request(checkpoint_url: str) -> tuple[dict | None, object, str]:
    fs, path = url_to_fs(f"{checkpoint_url.rstrip('/')}/{STOP_REQUEST}")
    try:
        with fs.open(path, "r") as f:
            req = json.load(f)
    except (FileNotFoundError, ValueError):
        return None, fs, path
    return (req if isinstance(req, dict) else None), fs, path


def stop_requested(checkpoint_url: str) -> bool:
    """Whether ``onceflow stop`` left a request in the checkpoint (the driver polls this)."""
    return _read_request(checkpoint_url)[0] is not None


def stop_request_id(checkpoint_url: str) -> str | None:
    """The id of the stop request ``onceflow stop`` left in the checkpoint, or None."""
    return (_read_request(checkpoint_url)[0] or {}).get("id")


def cancel_requested(checkpoint_url: str) -> bool:
    """Whether the stop request is ``onceflow cancel``'s: stop now, the in-flight batch
    abandoned (it is replayed by the next run), not after it."""
    return bool((_read_request(checkpoint_url)[0] or {}).get("immediate"))


def take_stop_request(checkpoint_url: str) -> dict | None:
    """The stop request written by ``onceflow stop``, consumed (removed) once read.

    Any request present is honoured, also one written before this driver started (the stop
    raced a supervisor restart): a request nobody consumed is removed by ``onceflow stop``
    itself once the job has stopped, so none survives into a later run."""
    req, fs, path = _read_request(checkpoint_url)
    try:
        fs.rm(path)
    except FileNotFoundError:
        pass
    return req


def _drop_own_request(url: str, rid: str) -> None:
    """After the job stopped: remove our request if no driver consumed it (e.g. the supervisor
    was waiting to restart), so a later run does not act on it."""
    req, fs, path = _read_request(url)
    if req is not None and req.get("id") == rid:
        try:
            fs.rm(path)
        except FileNotFoundError:
            pass


def stop_job(checkpoint_url: str, timeout: float = 300.0, poll: float = 0.2, *,
             savepoint: bool = False, target: str | None = None, immediate: bool = False) -> str:
    """Stop the job running on ``checkpoint_url`` gracefully (the in-flight batch finishes), or
    with ``immediate`` at once (``onceflow cancel``: the in-flight batch's tasks are cancelled
    and the batch is replayed by the next run; a batch already in its sink commit finishes it).

    First it leaves a stop request in the checkpoint, saying whether to take a savepoint (at
    ``target`` or the driver's default); every driver polls for it about once a second, so this
    works from any host that can reach the checkpoint. On the job's own host it also sends
    SIGTERM, to the supervisor of ``onceflow run`` (the event log's latest ``process_start``,
    if its pid still belongs to the process that started then) or to the driver holding the
    lease, for a stop without the polling delay. It then waits until the job has stopped and
    the lease is free. Returns what was stopped.
    """
    url = checkpoint_url.rstrip("/")
    events = EventLog(url)
    start, since = _supervisor(list(events.read()))
    sup = _live_supervisor(url, start)
    holder = live_lease_holder(url)
    here = socket.gethostname()
    pid: int | None = None
    if sup:
        pid, what = sup, f"supervisor pid {sup}"
    elif holder and holder.get("host") == here:
        pid, what = int(holder["pid"]), f"driver pid {holder['pid']}"
    elif holder:
        what = f"the driver on host {holder.get('host')} (pid {holder.get('pid')})"
    elif start and start.get("host") not in (None, here):
        raise SavepointError(
            f"the job on {url} was last supervised on host {start.get('host')} (pid "
            f"{start.get('supervisor_pid')}) and no driver holds its lease now (it is restarting, or "
            f"gone): retry in a few seconds, or run 'onceflow stop' there"
        )
    else:
        return "nothing (the job was not running)"
    if target and "://" not in target:
        target = os.path.abspath(target)  # the driver's working directory may differ
    asked = time.time()
    rid = _write_request(url, savepoint, target, immediate)
    if pid is not None:
        log.info("stopping %s of %s (SIGTERM; %s)", what, url,
                 "the in-flight batch is abandoned" if immediate else "the in-flight batch finishes first")
        os.kill(pid, signal.SIGTERM)
    else:
        log.info("stopping %s of %s: left a stop request, which it picks up within about a second "
                 "(the in-flight batch finishes first)", what, url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        free = live_lease_holder(url) is None  # read first: what a driver logs, it logs before it frees it
        if pid == sup and pid is not None:
            stopped = not _alive(pid) or any(
                e.get("event") == "stop" and e.get("scope") == "process" and float(e.get("ts", 0)) >= since
                for e in events.read())
        elif pid is not None:
            stopped = not _alive(pid)
        else:  # another host: the driver logs when it has acted on our request (savepoint
            # taken); or it stopped without seeing the request (then we act on it ourselves).
            # A driver that saw it logs so before it frees the lease, and acts on it after.
            seen = list(events.read())
            mine = [e.get("event") for e in seen if e.get("request") == rid]
            stopped = "stop_request_done" in mine or (
                "stop_request_seen" not in mine
                and any(e.get("event") == "stop" and float(e.get("ts", 0)) >= asked for e in seen)
                and stop_request_id(url) == rid)
        if stopped and free:
            _drop_own_request(url, rid)
            return what
        time.sleep(poll)
    raise SavepointError(f"{what} did not stop within {timeout:g}s; no savepoint was taken yet (the "
                         "stop request stays: when the job does stop, its driver acts on it)")


def _stop_savepoint_since(url: str, since: float) -> str | None:
    found = None
    for e in EventLog(url).read():
        if e.get("event") == "savepoint" and e.get("reason") == "stop" and float(e.get("ts", 0)) >= since:
            found = e.get("path")
    return found


def stop_with_savepoint(checkpoint_url: str, target: str | None = None, timeout: float = 300.0) -> tuple[str, Manifest]:
    """``onceflow stop --savepoint``: stop gracefully; the driver takes the savepoint of the
    last committed batch as it stops (or, when no driver took one, e.g. the job was waiting
    to restart, this function takes it of the stopped checkpoint)."""
    url = checkpoint_url.rstrip("/")
    if target and "://" not in target:
        target = os.path.abspath(target)  # the same place whoever takes it, reported as such
    since = time.time()
    stop_job(url, timeout, savepoint=True, target=target)
    taken = _stop_savepoint_since(url, since)
    if taken:
        return taken, read_manifest(taken)
    return create_savepoint(url, target, reason="stop")


def savepoint_on_stop(checkpoint_url: str, job_name: str, started: float,
                      environ: dict | None = None) -> tuple[str, Manifest] | None:
    """The driver's stop-with-savepoint, after its query stopped on request (SIGTERM/SIGINT).

    What to do comes from the stop request of ``onceflow stop`` if there is one (also one
    written before this driver's start at ``started``: the stop raced a supervisor restart),
    else from ``onceflow run``'s options: ``--no-savepoint-on-stop`` (no
    savepoint), ``--savepoint-dir DIR`` (default ``CHECKPOINT_DIR/../savepoints``); the target
    is ``DIR/<job>-<batch>-<UTC time>``. Returns None when no savepoint is wanted or nothing
    was committed yet; raises when taking it fails.
    """
    environ = os.environ if environ is None else environ
    url = checkpoint_url.rstrip("/")
    request = take_stop_request(url)
    try:
        return _act_on_stop(url, job_name, started, environ, request)
    finally:  # 'onceflow stop' on another host waits for this, not for the lease alone
        if request is not None:
            EventLog(url).append("stop_request_done", request=request.get("id"))


def _act_on_stop(url: str, job_name: str, started: float, environ, request: dict | None):
    if request is not None and float(request.get("ts", 0)) < started:
        log.info("acting on the stop request written before this driver started (%s)", request)
    if request is not None and not request.get("savepoint"):
        return None
    target = request.get("target") if request else None
    if request is None and environ.get(SAVEPOINT_ON_STOP_ENV) == "0":
        return None
    ckpt = CheckpointDir(url)
    last = ckpt.last_committed() if ckpt.exists() else None
    if last is None:
        log.warning("stopped before any batch was committed on %s: no savepoint to take", url)
        return None
    target = target or default_target(url, last, environ.get(SAVEPOINT_DIR_ENV) or default_savepoint_dir(url),
                                      prefix=job_name)
    return create_savepoint(url, target, job_name=job_name, reason="stop")
