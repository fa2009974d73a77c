"""The driver lease on a checkpoint: refuses a second driver early; safety never depends on it.

Guarantee: at most one driver *believes* it holds the lease at any epoch, and a driver that
learns it lost the lease stops its query. Exactly-once does not rest on this file (clocks,
pauses and object-store listings can all lie): the sinks' fencing epochs do. The lease only
makes the common cases (two ``onceflow run`` on one checkpoint, a successor taking over a
dead driver) fast and clear.

Layout: one record per holder, ``<checkpoint>/_onceflow/lease/<epoch>.json``, created with an
exclusive create (``open(..., "xb")``: O_EXCL locally, a conditional put on object stores:
s3fs sends ``If-None-Match: *`` and a store that already has the object answers 412, which
s3fs raises as FileExistsError), so two drivers can never hold the same epoch. A filesystem
that cannot create exclusively is refused (ConfigError), never used unsafely. The holder is
the record with the highest epoch. Each holder only ever rewrites its own record, whole (a
rename of a temporary file locally, one PUT on an object store; never an append or a rename
there), so a renewal never overwrites a newer holder. Listings bypass fsspec's listings cache.

* **acquire**: refused while the highest record's holder is alive (same host: its pid exists;
  other host: renewed within ``ttl_s``), unless ``takeover=True`` (the supervisor saw it die).
  Otherwise create ``<highest+1>.json``; losing that race is a FencedError.
* **renew** (every ``renew_s``): if a higher epoch exists, or no renewal succeeded for
  ``ttl_s`` (default 30 s, or ``ONCEFLOW_LEASE_TTL_S``; renewal every ttl/6, or
  ``ONCEFLOW_LEASE_RENEW_S``), the lease is *lost*: :attr:`DriverLease.lost` is set and the runner stops its
  query (self-fencing). Records of older epochs are removed by the new holder; a released
  record is kept (marked released) so epoch numbers only grow.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid

from onceflow.checkpoint.layout import CheckpointDir
from onceflow.errors import ConfigError, DriverLeaseLapsed, FencedError
from onceflow.storage import write_whole

log = logging.getLogger("onceflow.lease")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DriverLease:
    """Exclusive, renewable, epoch-numbered lease on a checkpoint directory."""

    def __init__(self, checkpoint: CheckpointDir | str, job_name: str, ttl_s: float | None = None,
                 renew_s: float | None = None):
        ttl_s = float(os.environ.get("ONCEFLOW_LEASE_TTL_S", 30.0)) if ttl_s is None else ttl_s
        if renew_s is None:
            renew_s = float(os.environ.get("ONCEFLOW_LEASE_RENEW_S", ttl_s / 6))
        ckpt = CheckpointDir.of(checkpoint)
        self.url = f"{ckpt.url}/_onceflow/lease"
        self.fs, self.dir = ckpt.fs, ckpt._p("_onceflow", "lease")
        self.job_name, self.ttl_s, self.renew_s = job_name, ttl_s, renew_s
        self.token = uuid.uuid4().hex
        self.epoch: int | None = None
        #: set (with :attr:`lost_reason`) when a newer holder appeared or renewal kept failing
        self.lost = threading.Event()
        self.lost_reason = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- records ---------------------------------------------------------------------------

    def _path(self, epoch: int) -> str:
        return f"{self.dir}/{epoch:012d}.json"

    def _epochs(self) -> list[int]:
        self.fs.invalidate_cache(self.dir)  # another driver's record must be seen at once
        try:
            names = self.fs.ls(self.dir, detail=False)
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            base = n.rstrip("/").rsplit("/", 1)[-1]
            if base.endswith(".json") and base[:-5].isdigit():
                out.append(int(base[:-5]))
        return sorted(out)

    def _read(self, epoch: int) -> dict | None:
        try:
            with self.fs.open(self._path(epoch), "r") as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except ValueError:  # being written right now (exclusive create, then the content)
            try:
                mtime = self.fs.modified(self._path(epoch)).timestamp()
            except (OSError, NotImplementedError):
                mtime = time.time()
            return {"host": "?", "pid": 0, "renewed": mtime, "epoch": epoch}

    def _record(self) -> dict:
        return {"token": self.token, "epoch": self.epoch, "host": socket.gethostname(),
                "pid": os.getpid(), "job": self.job_name, "renewed": time.time()}

    def holder(self) -> dict | None:
        """The record of the live holder (highest epoch), or None when nobody holds it."""
        epochs = self._epochs()
        rec = self._read(epochs[-1]) if epochs else None
        return rec if rec and self._alive(rec) else None

    def _alive(self, rec: dict) -> bool:
        if rec.get("token") == self.token or rec.get("released"):
            return False
        if rec.get("host") == socket.gethostname():
            return _pid_alive(int(rec.get("pid", 0)))
        # another host: lapsed once not renewed for a TTL plus one renewal period, so the holder
        # (which gives itself up after a TTL without renewal) is gone before a successor comes
        return time.time() - float(rec.get("renewed", 0)) < self.ttl_s + self.renew_s

    # ---- acquire / renew / release ---------------------------------------------------------

    def _create(self, epoch: int) -> bool:
        """Exclusively create the record of ``epoch``; False when another driver created it."""
        self.epoch = epoch
        try:
            with self.fs.open(self._path(epoch), "xb") as f:
                f.write(json.dumps(self._record()).encode())
        except FileExistsError:
            self.epoch = None
            return False
        except (NotImplementedError, ValueError) as e:
            raise ConfigError(f"the checkpoint filesystem of {self.url} cannot create files "
                              f"exclusively ({e}); use a filesystem with conditional writes") from None
        return True

    def acquire(self, takeover: bool = False, wait_s: float | None = None) -> DriverLease:
        """Take the next epoch; FencedError while a live driver holds the lease.

        ``wait_s`` (default ``ONCEFLOW_LEASE_WAIT_S``, else 0): wait that long for a live
        holder's lease to lapse (a driver on another host that stopped renewing) before giving
        up, so a driver started on a second host can stand by for the first one.
        """
        self.fs.makedirs(self.dir, exist_ok=True)
        if wait_s is None:
            wait_s = float(os.environ.get("ONCEFLOW_LEASE_WAIT_S", 0))
        deadline, said = time.monotonic() + wait_s, 0.0
        while True:
            epochs = self._epochs()
            top = epochs[-1] if epochs else 0
            rec = self._read(top) if epochs else None
            held = bool(rec and not takeover and self._alive(rec))
            if not held and self._create(top + 1):
                break
            if time.monotonic() >= deadline:
                if not held:  # lost the race for top + 1 to another driver
                    raise FencedError(f"another driver took the lease on {self.url} (epoch {top + 1}) "
                                      "at the same moment; retry")
                raise FencedError(
                    f"job {rec.get('job')!r} is already running on this checkpoint (pid {rec.get('pid')} "
                    f"on {rec.get('host')}, lease epoch {top}); stop it first (SIGTERM or 'onceflow "
                    "stop'), or use another checkpoint directory for a second copy ('onceflow run "
                    "--from-savepoint SP --fork')"
                )
            if held and time.monotonic() - said >= 30:
                said = time.monotonic()
                log.info("waiting up to %.0fs for the lease of pid %s on %s (epoch %s) to lapse",
                         deadline - said, rec.get("pid"), rec.get("host"), top)
            time.sleep(min(1.0, self.renew_s))
        for old in epochs:  # older holders are gone or fenced: keep the directory small
            try:
                self.fs.rm(self._path(old))
            except FileNotFoundError:
                pass
        self._thread = threading.Thread(target=self._renew, name="onceflow-lease", daemon=True)
        self._thread.start()
        return self

    def _renew(self) -> None:
        last_ok = time.monotonic()
        while not self._stop.wait(self.renew_s):
            try:
                newer = [e for e in self._epochs() if e > (self.epoch or 0)]
                if newer:
                    self._lose(f"a newer driver took the lease (epoch {newer[-1]} > {self.epoch})")
                    return
                write_whole(self.fs, self._path(self.epoch or 0), json.dumps(self._record()).encode())
                last_ok = time.monotonic()
            except OSError as e:
                if time.monotonic() - last_ok > self.ttl_s:
                    self._lose(f"the lease could not be renewed for {self.ttl_s:g}s ({e})")
                    return

    def check(self) -> None:
        """FencedError now if a newer driver took the lease (a synchronous look)."""
        newer = [e for e in self._epochs() if e > (self.epoch or 0)]
        if newer:
            self._lose(f"a newer driver took the lease (epoch {newer[-1]} > {self.epoch})")
        if self.lost.is_set():
            raise FencedError(self.lost_reason)

    def _lose(self, reason: str) -> None:
        self.lost_reason = reason
        self.lost.set()

    def release(self) -> None:
        """Mark the record released (kept, so epoch numbers keep growing); never a newer one."""
        self._stop.set()
        if self.epoch is None or self.lost.is_set():
            return
        rec = self._read(self.epoch)
        if rec and rec.get("token") == self.token and self._epochs()[-1:] == [self.epoch]:
            with self.fs.open(self._path(self.epoch), "w") as f:
                json.dump({**rec, "released": time.time()}, f)

    def __enter__(self) -> DriverLease:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def check_driver_lease(checkpoint_url: str, epoch: int, ttl_s: float) -> None:
    """For a query that can outlive its driver (started over Spark Connect, it runs on the
    server when the client is gone): FencedError when a newer driver took the lease,
    DriverLeaseLapsed when the driver of ``epoch`` released it or has not renewed it for
    ``ttl_s``. Called before each batch's decision, so such a query stops committing within
    a TTL of its driver's death."""
    lease = DriverLease(checkpoint_url, "?", ttl_s=ttl_s)
    epochs = lease._epochs()
    if epochs and epochs[-1] > epoch:
        raise FencedError(f"a newer driver took the lease of {checkpoint_url} (epoch {epochs[-1]} > "
                          f"{epoch}): this query, started by the driver of epoch {epoch}, stops")
    rec = lease._read(epoch)
    age = time.time() - float(rec.get("renewed", 0)) if rec else float("inf")
    if rec is None or rec.get("released") or age > ttl_s:
        who = f"pid {rec.get('pid')} on {rec.get('host')}" if rec else "its driver"
        raise DriverLeaseLapsed(
            f"the driver that started this query ({who}, lease epoch {epoch} of {checkpoint_url}) "
            + ("released its lease" if rec and rec.get("released") else
               f"has not renewed its lease for {age:.0f}s (TTL {ttl_s:g}s)")
            + ": it died or is paused, so the query stops instead of committing without it; "
            "'onceflow run' resumes it from the checkpoint")
