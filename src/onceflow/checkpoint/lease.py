"""The driver fence on a checkpoint: one running driver per lineage.

A lease file ``<checkpoint>/_onceflow/driver.lease`` names the holder (host, pid) and is
renewed every ``renew_s``. A second driver is refused while the holder lives (same host:
its pid exists; other host: its lease was renewed within ``ttl_s``). A holder killed with
SIGKILL leaves the file behind; its successor on the same host takes over at once.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid

from fsspec.core import url_to_fs

from onceflow.errors import FencedError


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DriverLease:
    """Exclusive, renewable lease on a checkpoint directory."""

    def __init__(self, checkpoint_url: str, job_name: str, ttl_s: float = 30.0, renew_s: float = 5.0):
        self.url = f"{checkpoint_url.rstrip('/')}/_onceflow/driver.lease"
        self.fs, self.path = url_to_fs(self.url)
        self.job_name, self.ttl_s, self.renew_s = job_name, ttl_s, renew_s
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> dict | None:
        try:
            with self.fs.open(self.path, "r") as f:
                return json.load(f)
        except (FileNotFoundError, ValueError):
            return None

    def _write(self) -> None:
        record = {"token": self.token, "host": socket.gethostname(), "pid": os.getpid(),
                  "job": self.job_name, "renewed": time.time()}
        tmp = f"{self.path}.{self.token}"
        with self.fs.open(tmp, "w") as f:
            json.dump(record, f)
        self.fs.mv(tmp, self.path)

    def _holder_alive(self, rec: dict) -> bool:
        if rec.get("token") == self.token:
            return False
        if rec.get("host") == socket.gethostname():
            return _pid_alive(int(rec.get("pid", 0)))
        return time.time() - float(rec.get("renewed", 0)) < self.ttl_s

    def acquire(self) -> DriverLease:
        self.fs.makedirs(self.path.rsplit("/", 1)[0], exist_ok=True)
        rec = self._read()
        if rec and self._holder_alive(rec):
            raise FencedError(
                f"job {rec.get('job')!r} is already running on this checkpoint (pid {rec.get('pid')} "
                f"on {rec.get('host')}); stop it first (SIGTERM or 'onceflow stop'), or use another "
                "checkpoint directory for a second copy ('onceflow run --from-savepoint SP --fork')"
            )
        self._write()
        time.sleep(0.05)
        rec = self._read()
        if not rec or rec.get("token") != self.token:
            raise FencedError(f"another driver took the lease on {self.url} at the same moment; retry")
        self._thread = threading.Thread(target=self._renew, name="onceflow-lease", daemon=True)
        self._thread.start()
        return self

    def _renew(self) -> None:
        while not self._stop.wait(self.renew_s):
            try:
                rec = self._read()
                if rec and rec.get("token") == self.token:
                    self._write()
            except OSError:
                continue

    def release(self) -> None:
        self._stop.set()
        rec = self._read()
        if rec and rec.get("token") == self.token:
            self.fs.rm(self.path)

    def __enter__(self) -> DriverLease:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
