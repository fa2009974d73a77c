"""The jobs under a checkpoint root, for ``onceflow list`` (Flink's ``flink list``).

A job is a checkpoint directory: one holding Spark's ``metadata`` or onceflow's
``_onceflow/``. Its state comes from the driver lease and the event log:

* **running**: the lease's newest record is held: its process runs (same host and PID
  namespace), or, for a holder on another host, its record was renewed within its lapse time
  by the wall clock (a display only: no decision rests on another host's clock);
* **restarting**: nobody holds the lease, and the supervisor of ``onceflow run`` that logged
  the last driver start still runs on this host (it waits out a restart delay);
* otherwise from the last lifecycle event: **fenced** (a newer driver took over and this one
  stopped), **failed** (a configuration error, a restart strategy that gave up, a savepoint
  on stop that failed, or a driver or supervisor that vanished without a ``stop`` event), else
  **stopped** (finished, or stopped on request).

Lag is shown where the source reports it: a ``lag`` figure in records (a number, or one per
partition/shard) in the last ``batch`` event, or ``lag_ms`` per stream and shard (Kinesis:
the largest, in seconds); else None.
"""

from __future__ import annotations

import socket
import time
from dataclasses import asdict, dataclass
from typing import Any

from onceflow.checkpoint.eventlog import EVENTS_DIR, EventLog
from onceflow.checkpoint.layout import CheckpointDir
from onceflow.checkpoint.lease import DriverLease
from onceflow.checkpoint.lease.identity import local_liveness
from onceflow.process import start_time
from onceflow.storage import url_to_fs

#: lifecycle events that decide a stopped job's state
_LIFECYCLE = {"process_start", "start", "restart", "stop", "gave_up", "failed"}
_FAILED_STOPS = {"config_error", "gave_up_in_process", "savepoint_failed"}
#: directories never searched: savepoints hold a checkpoint copy, tables hold no checkpoint
_SKIP = ("_savepoint.json", "_delta_log")


@dataclass
class JobStatus:
    """One row of ``onceflow list``."""

    checkpoint: str
    name: str
    state: str  #: running | restarting | stopped | fenced | failed
    holder_host: str | None = None
    holder_pid: int | None = None
    holder_epoch: int | None = None
    last_batch: int | None = None
    last_batch_ts: float | None = None  #: when it was committed (event log, else file time)
    lag: float | None = None  #: source lag of the last batch in records, where the source reports it
    lag_s: float | None = None  #: or in seconds behind the tip (Kinesis: the largest shard's)

    def age_s(self, now: float | None = None) -> float | None:
        if self.last_batch_ts is None:
            return None
        return max(0.0, (time.time() if now is None else now) - self.last_batch_ts)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "last_batch_age_s": self.age_s()}


def is_job_checkpoint(fs: Any, path: str) -> bool:
    return fs.exists(f"{path}/metadata") or fs.isdir(f"{path}/{EVENTS_DIR}")


def find_checkpoints(root: str, depth: int = 4) -> list[str]:
    """URLs of the checkpoint directories at ``root`` or up to ``depth`` levels below it
    (a checkpoint's own subdirectories, savepoints and Delta tables are not searched)."""
    root = root.rstrip("/") or "/"
    fs, base = url_to_fs(root)
    found: list[str] = []

    def walk(url: str, path: str, left: int) -> None:
        if is_job_checkpoint(fs, path):
            found.append(url)
            return
        if left == 0:
            return
        try:
            children = fs.ls(path, detail=True)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            return
        names = {c["name"].rstrip("/").rsplit("/", 1)[-1] for c in children}
        if any(s in names for s in _SKIP):
            return
        for c in sorted(children, key=lambda c: c["name"]):
            if c.get("type") != "directory":
                continue
            name = c["name"].rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("."):
                continue
            walk(f"{url.rstrip('/')}/{name}", c["name"].rstrip("/"), left - 1)

    walk(root, base.rstrip("/") or "/", depth)
    return found


def _held(rec: dict | None, lease: DriverLease, now: float) -> bool:
    if not rec or rec.get("released") or rec.get("partial"):
        return False
    local = local_liveness(rec)
    if local is not None:
        return local
    try:  # another host: its renewals, by the wall clock (display only)
        return now - float(rec.get("renewed", 0)) <= lease.lapse_s(rec)
    except (TypeError, ValueError):
        return False


def _lag(event: dict) -> float | None:
    lag = event.get("lag")
    if isinstance(lag, bool):
        return None
    if isinstance(lag, (int, float)):
        return lag
    if isinstance(lag, dict):  # per partition or shard (possibly per source)
        values = [v for v in _leaves(lag) if isinstance(v, (int, float)) and not isinstance(v, bool)]
        return sum(values) if values else None
    return None


def _leaves(d: dict) -> list:
    out = []
    for v in d.values():
        out += _leaves(v) if isinstance(v, dict) else [v]
    return out


def _stopped_state(last: dict | None) -> str:
    if last is None:
        return "stopped"
    kind, reason = last.get("event"), last.get("reason")
    if (kind == "stop" and reason == "fenced") or (kind == "failed" and last.get("error") == "FencedError"):
        return "fenced"
    if kind in ("gave_up", "failed") or (kind == "stop" and reason in _FAILED_STOPS):
        return "failed"
    if kind == "stop" and (last.get("exit_code") in (None, 0) or reason != "signal"):
        return "stopped"
    return "failed"  # a stop that failed, or a start/restart never followed by a stop


def _supervisor_runs(start: dict | None) -> bool:
    """Whether the supervisor that logged ``start`` (a ``process_start``) runs on this host."""
    if not start or start.get("host") != socket.gethostname() or not start.get("supervisor_pid"):
        return False
    now = start_time(int(start["supervisor_pid"]))
    return now is not None and start.get("supervisor_started") in (None, now)


def job_status(url: str, now: float | None = None) -> JobStatus:
    """The state of the job on checkpoint ``url`` (see module doc)."""
    now = time.time() if now is None else now
    ckpt = CheckpointDir(url)
    lease = DriverLease(ckpt, "onceflow-list")
    try:
        rec = lease.top()
    except Exception:  # noqa: BLE001 - an unreadable lease shows as no holder
        rec = None
    name, last, started, batches = None, None, None, {}
    for e in EventLog(ckpt).read():
        kind = e.get("event")
        if kind == "start" and e.get("job"):
            name = e["job"]
        if kind in _LIFECYCLE:
            last = e
        if kind == "process_start":
            started = e
        elif kind in ("stop", "gave_up") and e.get("scope") == "process":
            started = None
        if kind == "batch" and isinstance(e.get("batch"), int):
            batches[e["batch"]] = e
    committed = ckpt.last_committed()
    state = ("running" if _held(rec, lease, now) else "restarting" if _supervisor_runs(started)
             else _stopped_state(last))
    status = JobStatus(ckpt.url, name or (rec or {}).get("job") or ckpt.url.rsplit("/", 1)[-1], state)
    if rec:
        status.holder_host, status.holder_pid = rec.get("host"), rec.get("pid")
        status.holder_epoch = rec.get("epoch")
    if committed is not None:
        status.last_batch = committed
        event = batches.get(committed)
        if event is not None:
            status.last_batch_ts, status.lag = event.get("ts"), _lag(event)
            ms = [v for v in _leaves(event.get("lag_ms") or {}) if isinstance(v, (int, float))]
            status.lag_s = max(ms) / 1000 if ms else None
        else:
            try:
                status.last_batch_ts = float(ckpt.fs.modified(ckpt._p("commits", str(committed))).timestamp())
            except Exception:  # noqa: BLE001 - no modification time on this store
                pass
    return status


def list_jobs(root: str, depth: int = 4) -> list[JobStatus]:
    """:func:`job_status` of every checkpoint :func:`find_checkpoints` finds under ``root``."""
    return [job_status(url) for url in find_checkpoints(root, depth)]
