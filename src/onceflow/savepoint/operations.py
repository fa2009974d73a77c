"""Savepoint operations besides create and restore: list, inspect, dispose, stop-with-savepoint."""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field

from fsspec.core import url_to_fs

from onceflow.checkpoint.eventlog import EventLog
from onceflow.checkpoint.layout import CheckpointDir
from onceflow.savepoint.create import create_savepoint, default_target, live_lease_holder
from onceflow.savepoint.manifest import (
    MANIFEST,
    Manifest,
    SavepointError,
    is_savepoint,
    read_manifest,
)
from onceflow.savepoint.transfer import sha256_of

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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _supervisor(events: list[dict]) -> tuple[int | None, float]:
    """(supervisor pid, ts) of the latest ``process_start`` not followed by a process ``stop``."""
    pid, ts = None, 0.0
    for e in events:
        if e.get("event") == "process_start":
            pid, ts = e.get("supervisor_pid"), float(e.get("ts", 0))
        elif e.get("event") in ("stop", "gave_up") and e.get("scope") == "process":
            pid = None
    return pid, ts


def stop_job(checkpoint_url: str, timeout: float = 300.0, poll: float = 0.2) -> str:
    """Stop the job running on ``checkpoint_url`` gracefully (the in-flight batch finishes).

    Sends SIGTERM to the supervisor of ``onceflow run`` (found in the event log), or to the
    driver holding the lease when it runs without a supervisor, and waits until the supervisor
    has logged its ``stop`` event and the lease is free. Returns what was stopped.
    """
    url = checkpoint_url.rstrip("/")
    events = EventLog(url)
    sup, since = _supervisor(list(events.read()))
    holder = live_lease_holder(url)
    if sup and _alive(int(sup)):
        target, what = int(sup), f"supervisor pid {sup}"
    elif holder and holder.get("host") == socket.gethostname():
        target, what = int(holder["pid"]), f"driver pid {holder['pid']}"
    elif holder:
        raise SavepointError(
            f"the job on {url} runs on another host ({holder.get('host')}, pid {holder.get('pid')}); "
            "stop it there, then run 'onceflow savepoint create'"
        )
    else:
        return "nothing (the job was not running)"
    log.info("stopping %s of %s (SIGTERM; the in-flight batch finishes first)", what, url)
    os.kill(target, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stopped = not _alive(target) or any(
            e.get("event") == "stop" and e.get("scope") == "process" and float(e.get("ts", 0)) >= since
            for e in events.read()
        ) if target == sup else not _alive(target)
        if stopped and live_lease_holder(url) is None:
            return what
        time.sleep(poll)
    raise SavepointError(f"{what} did not stop within {timeout:g}s; no savepoint was taken")


def stop_with_savepoint(checkpoint_url: str, target: str | None = None, timeout: float = 300.0) -> tuple[str, Manifest]:
    """``onceflow stop --savepoint``: stop gracefully, then snapshot the last committed batch."""
    stop_job(checkpoint_url, timeout)
    return create_savepoint(checkpoint_url, target)
