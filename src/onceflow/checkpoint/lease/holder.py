"""DriverLease: take, renew, check and release the driver lease of one checkpoint."""

from __future__ import annotations

import enum
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

from onceflow.checkpoint.layout import CheckpointDir
from onceflow.checkpoint.lease import identity
from onceflow.checkpoint.lease.sighting import SIGHTINGS, held_s
from onceflow.errors import ConfigError, FencedError, LeaseLost, OnceflowError, StoreUnavailable
from onceflow.outages import Stopped
from onceflow.settings import setting
from onceflow.storage import write_whole

log = logging.getLogger("onceflow.lease")
T = TypeVar("T")
FORMAT = 2  # records without "format" were written by onceflow before holder identities


class Verdict(enum.Enum):
    HELD = "held"  #: its process runs here, or its record changed under this reader's eyes
    FREE = "free"  #: released, ours, its process is gone, or seen unchanged for the lapse time
    UNKNOWN = "unknown"  #: seen, but not yet for the lapse time, and never seen renewed


def store_call(what: str, fn: Callable[[], T]) -> T:
    """``fn()``, with any storage error (OSError, botocore's, aiohttp's...) but a missing
    or existing file raised as :class:`StoreUnavailable` naming ``what`` failed."""
    try:
        return fn()
    except (FileNotFoundError, FileExistsError, OnceflowError):
        raise
    except Exception as e:
        raise StoreUnavailable(f"{what} failed ({type(e).__name__}: {e})", e) from e


class DriverLease:
    """Exclusive, renewable, epoch-numbered lease on a checkpoint directory."""

    def __init__(self, checkpoint: CheckpointDir | str, job_name: str, ttl_s: float | None = None,
                 renew_s: float | None = None):
        ttl_s = float(setting("ONCEFLOW_LEASE_TTL_S", "30")) if ttl_s is None else ttl_s
        if renew_s is None:
            renew_s = float(setting("ONCEFLOW_LEASE_RENEW_S", str(ttl_s / 6)))
        ckpt = CheckpointDir.of(checkpoint)  # resolved once, handed down
        self.url = f"{ckpt.url}/_onceflow/lease"
        self.fs, self.dir = ckpt.fs, ckpt._p("_onceflow", "lease")
        self.job_name, self.ttl_s, self.renew_s = job_name, ttl_s, renew_s
        self.token = uuid.uuid4().hex
        self.epoch: int | None = None
        #: set (with :attr:`lost_reason`) when a newer holder appeared or renewal kept failing
        self.lost = threading.Event()
        self.lost_reason = ""
        self.lost_to_newer = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._renewals = 0
        self.waited = False  #: another driver held the lease when acquire() began (see acquire)
        self._acquired_at = 0.0  # identity.clock() when the create of our record started
        self._renewed_at = 0.0  # ... when the last successful write of our record started
        self._tried_at = 0.0  # ... when the last attempt to write it started

    # ---- records ---------------------------------------------------------------------------

    def _path(self, epoch: int) -> str:
        return f"{self.dir}/{epoch:012d}.json"

    def _epochs(self) -> list[int]:
        def ls() -> list[str]:
            self.fs.invalidate_cache(self.dir)  # another driver's record must be seen at once
            try:
                return self.fs.ls(self.dir, detail=False)
            except FileNotFoundError:
                return []

        out = []
        for n in store_call(f"listing the lease records in {self.url}", ls):
            base = n.rstrip("/").rsplit("/", 1)[-1]
            if base.endswith(".json") and base[:-5].isdigit():
                out.append(int(base[:-5]))
        return sorted(out)

    def _read(self, epoch: int) -> tuple[bytes, dict] | None:
        """The record's bytes and fields; None when it does not exist. A record created but
        not yet written (or cut short) has no fields but its epoch: it counts as a holder
        whose liveness only its renewals can show."""
        def cat() -> bytes | None:
            try:
                return self.fs.cat_file(self._path(epoch))
            except FileNotFoundError:
                return None

        raw = store_call(f"reading lease record {self._path(epoch)}", cat)
        if raw is None:
            return None
        try:
            rec = json.loads(raw)
            if not isinstance(rec, dict):
                raise ValueError("not an object")
        except ValueError:
            rec = {"host": "?", "pid": "?", "epoch": epoch, "partial": True}
        return raw, rec

    def _record(self, held: float) -> dict:
        """Our record. ``renewed`` (wall clock) is for people and for readers of onceflow
        before format 2; no decision of format 2 rests on it."""
        return {"format": FORMAT, "token": self.token, "epoch": self.epoch, "job": self.job_name,
                **identity.own(), "renewals": self._renewals, "held_s": round(held, 3),
                "ttl_s": self.ttl_s, "renew_s": self.renew_s, "renewed": time.time()}

    def lapse_s(self, rec: dict) -> float:
        """How long a reader must see ``rec`` unchanged before it counts as lapsed: the
        holder's TTL (it gives itself up then) plus one of its renewal periods."""
        def num(key: str, default: float) -> float:
            try:
                return float(rec.get(key, default))
            except (TypeError, ValueError):
                return default

        return max(self.ttl_s, num("ttl_s", self.ttl_s)) + max(0.0, num("renew_s", self.renew_s))

    def _judge(self, epoch: int, found: tuple[bytes, dict] | None, read_at: float) -> tuple[Verdict, str]:
        """The verdict on record ``epoch``, read by a read that began at ``read_at``
        (:func:`identity.clock`), and why, in words for a log line."""
        if found is None:
            return Verdict.FREE, "no record"
        raw, rec = found
        if rec.get("token") == self.token:
            return Verdict.FREE, "our own record"
        if rec.get("released"):
            return Verdict.FREE, "released"
        local = identity.local_liveness(rec)
        if local is False:
            return Verdict.FREE, f"its process (pid {rec.get('pid')}) is gone from this host"
        held = held_s(rec)
        seen, now = SIGHTINGS.see(self.url, epoch, raw, held, read_at)
        quiet, lapse = seen.silent_s(held, now), self.lapse_s(rec)
        if quiet >= lapse:
            return Verdict.FREE, f"not renewed for {quiet:.1f}s by this host's clock (lapse {lapse:g}s)"
        if local or seen.changed:
            return Verdict.HELD, ("its process runs" if local else "it renews")
        return Verdict.UNKNOWN, f"seen unchanged for {quiet:.1f}s of {lapse:g}s"

    def top(self) -> dict | None:
        """The fields of the highest epoch's record, whoever wrote it and whether or not its
        holder lives (None: no record yet). :class:`StoreUnavailable` when unreadable."""
        epochs = self._epochs()
        found = self._read(epochs[-1]) if epochs else None
        return found[1] if found else None

    def holder(self, settle: bool = False, retry_s: float = 0.0) -> dict | None:
        """The record of the live holder (highest epoch), or None when nobody holds it.

        A record this process has not watched long enough to judge counts as held (like a
        new Kubernetes candidate, which waits a full lease duration); readers that call again
        later decide from what they saw meanwhile (sightings are kept per process). With
        ``settle``, watch the record until it is decided: at most one of the holder's renewal
        periods when it lives, its lapse time when it does not.

        Storage errors are :class:`StoreUnavailable` (never a raw storage library error);
        with ``retry_s`` > 0 they are retried for that long first (``math.inf``: until the
        store answers), one warning line per failed attempt.
        """
        deadline, attempt = identity.clock() + retry_s, 0
        while True:
            try:
                read_at = identity.clock()
                epochs = self._epochs()
                found = self._read(epochs[-1]) if epochs else None
                verdict, _ = self._judge(epochs[-1], found, read_at) if epochs else (Verdict.FREE, "")
                if verdict is Verdict.UNKNOWN and settle:
                    time.sleep(self._poll_s(found[1] if found else {}))
                    continue
                return found[1] if found and verdict is not Verdict.FREE else None
            except StoreUnavailable as e:
                left = deadline - identity.clock()
                if left <= 0:
                    raise
                pause, attempt = min(5.0, left, 0.5 * 2 ** attempt), attempt + 1
                log.warning("%s; the lease holder of %s waits: retrying in %.1fs", e, self.url, pause)
                time.sleep(pause)

    def _poll_s(self, rec: dict) -> float:
        try:
            theirs = float(rec.get("renew_s", self.renew_s))
        except (TypeError, ValueError):
            theirs = self.renew_s
        return max(0.01, min(1.0, self.renew_s, theirs / 2))

    # ---- acquire / renew / release ---------------------------------------------------------

    def _create(self, epoch: int) -> bool:
        """Exclusively create the record of ``epoch``; False when another driver created it."""
        self.epoch, self._renewals, started = epoch, 0, identity.clock()

        def create() -> None:
            with self.fs.open(self._path(epoch), "xb") as f:
                f.write(json.dumps(self._record(0.0)).encode())

        try:
            store_call(f"creating lease record {self._path(epoch)}", create)
        except FileExistsError:
            self.epoch = None
            return False
        except StoreUnavailable as e:
            self.epoch = None
            if isinstance(e.cause, (NotImplementedError, ValueError)):
                raise ConfigError(f"the checkpoint filesystem of {self.url} cannot create files "
                                  f"exclusively ({e.cause}); use a filesystem with conditional writes") from None
            raise
        self._acquired_at = self._renewed_at = self._tried_at = started
        return True

    def acquire(self, takeover: bool | int = False, wait_s: float | None = None,
                stop: threading.Event | None = None) -> DriverLease:
        """Take the next epoch; FencedError while a live driver holds the lease.

        ``takeover``: ``True`` takes the lease whoever holds it (fencing them); an epoch ``E``
        takes it over only from the holder of epoch E (a dead driver the caller's supervisor
        started): if someone else took the lease since, it is judged like any holder.

        ``wait_s`` (default ``ONCEFLOW_LEASE_WAIT_S``, else 0): wait that long for a live
        holder's lease to lapse, standing by (one log line every 30 s says so). A holder
        this process cannot judge at once (in another PID namespace or on another host) is
        watched until it shows a renewal (refused: it lives) or its lapse time passes (taken),
        even with ``wait_s`` 0: a restarted container takes over its own dead predecessor.
        Storage errors are retried, one warning per attempt, for ``max(wait_s, ttl)``, then
        raised as :class:`StoreUnavailable` (not fatal: the restart strategy retries). A set
        ``stop`` ends the wait with :class:`~onceflow.outages.Stopped`, nothing taken.
        ``waited`` says afterwards whether another driver held the lease when this one came.
        """
        if wait_s is None:
            wait_s = float(setting("ONCEFLOW_LEASE_WAIT_S", "0"))
        start = identity.clock()
        deadline, store_deadline = start + wait_s, start + max(wait_s, self.ttl_s)
        said, said_what = -1e18, None
        while True:
            try:
                store_call(f"creating {self.url}", lambda: self.fs.makedirs(self.dir, exist_ok=True))
                read_at = identity.clock()
                epochs = self._epochs()
                top = epochs[-1] if epochs else 0
                found = self._read(top) if epochs else None
                if takeover is True or (takeover is not False and top == takeover):
                    verdict, why = Verdict.FREE, "takeover"
                else:
                    verdict, why = self._judge(top, found, read_at)
                if verdict is Verdict.FREE and self._create(top + 1):
                    break
            except StoreUnavailable as e:
                if identity.clock() >= store_deadline:
                    raise
                log.warning("%s; taking the lease waits: retrying in %.1fs", e, min(1.0, self.renew_s))
                time.sleep(min(1.0, self.renew_s))
                continue
            rec = found[1] if found else {}
            now = identity.clock()
            if verdict is Verdict.FREE and now >= deadline:  # lost the race for top + 1
                raise FencedError(f"another driver took the lease on {self.url} (epoch {top + 1}) "
                                  "at the same moment; retry")
            if verdict is Verdict.HELD and now >= deadline:
                raise FencedError(
                    f"job {rec.get('job')!r} is already running on this checkpoint (pid {rec.get('pid')} "
                    f"on {rec.get('host')}, lease epoch {top}: {why}); stop it first (SIGTERM or "
                    "'onceflow stop'), or use another checkpoint directory for a second copy ('onceflow "
                    "run --from-savepoint SP --fork'); 'onceflow run --wait-for-lease SECONDS' stands by "
                    "for it instead"
                )
            self.waited = self.waited or verdict is not Verdict.FREE
            if verdict is not Verdict.FREE and (now - said >= 30 or said_what is not verdict):
                said, said_what = now, verdict
                if verdict is Verdict.HELD:
                    log.info("standing by: pid %s on %s holds the lease of %s (epoch %s; %s); waiting "
                             "%s for it to end or lapse", rec.get("pid"), rec.get("host"), self.url, top, why,
                             "as long as it lives" if deadline == math.inf else f"up to {deadline - now:.0f}s more")
                else:
                    log.info("the lease of %s is held by pid %s on %s (epoch %s), which this host "
                             "cannot check: watching its record until it renews or lapses (%s)",
                             self.url, rec.get("pid"), rec.get("host"), top, why)
            if stop is None:
                time.sleep(self._poll_s(rec))
            elif stop.wait(self._poll_s(rec)):
                raise Stopped(f"standing by for the lease of {self.url}")
        if found is not None and why != "our own record":
            rec = found[1]
            log.info("took the lease of %s (epoch %s) from pid %s on %s, epoch %s: %s", self.url, self.epoch,
                     rec.get("pid"), rec.get("host"), top, why)
        for old in epochs:  # older holders are gone or fenced: keep the directory small
            try:
                store_call(f"removing {self._path(old)}", lambda old=old: self.fs.rm(self._path(old)))
            except (FileNotFoundError, StoreUnavailable):
                pass
        self._thread = threading.Thread(target=self._renew_loop, name="onceflow-lease", daemon=True)
        self._thread.start()
        return self

    def _renew_loop(self) -> None:
        """Renew until stopped or lost; survives every error (it logs and retries)."""
        try:
            while not self._stop.wait(self._next_wait()):
                if self._lapsed():
                    return
                try:
                    newer = [e for e in self._epochs() if e > (self.epoch or 0)]
                    if newer:
                        self._lose(f"a newer driver took the lease (epoch {newer[-1]} > {self.epoch})", True)
                        return
                    started = identity.clock()
                    if started - self._tried_at > max(2 * self.renew_s, self.ttl_s / 2):
                        log.warning("lease renewal of epoch %s comes %.1fs after the last attempt (period "
                                    "%gs, TTL %gs): this process was paused or starved, or the store is slow",
                                    self.epoch, started - self._tried_at, self.renew_s, self.ttl_s)
                    self._tried_at = started
                    self._renewals += 1
                    record = json.dumps(self._record(started - self._acquired_at)).encode()
                    store_call(f"renewing lease record {self._path(self.epoch or 0)}",
                               lambda record=record: write_whole(self.fs, self._path(self.epoch or 0), record))
                    self._renewed_at = started
                except Exception as e:  # every error: an outage to wait out, up to the TTL
                    left = max(0.0, self._renewed_at + self.ttl_s - identity.clock())
                    what = str(e) if isinstance(e, StoreUnavailable) else f"{type(e).__name__}: {e}"
                    log.warning("lease renewal of epoch %s failed (%s); the driver keeps its lease for "
                                "%.1fs more and retries in %.1fs", self.epoch, what, left,
                                min(self.renew_s, left))
        except BaseException as e:  # never die silently: a holder that cannot renew gives up
            log.exception("the lease renewal thread of epoch %s failed", self.epoch)
            self._lose(f"the lease renewal thread failed ({type(e).__name__}: {e})")

    def _next_wait(self) -> float:
        """The renewal period, or less: wake when the TTL since the last renewal runs out."""
        return max(0.0, min(self.renew_s, self._renewed_at + self.ttl_s - identity.clock()))

    def _lapsed(self) -> bool:
        """True (and lost) once no renewal succeeded for the TTL, on this process's clock."""
        quiet = identity.clock() - self._renewed_at
        if self.epoch is not None and quiet >= self.ttl_s and not self.lost.is_set():
            self._lose(f"the lease could not be renewed for {self.ttl_s:g}s (last renewal "
                       f"{quiet:.1f}s ago by this process's clock)")
        return self.lost.is_set()

    def check(self) -> None:
        """FencedError now if a newer driver took the lease or this holder's own TTL ran out
        without a renewal (its own clock; a synchronous look). A store that cannot be read
        leaves only the second test (logged)."""
        try:
            newer = [e for e in self._epochs() if e > (self.epoch or 0)]
        except StoreUnavailable as e:
            log.warning("%s: checking the lease relies on this driver's own renewals", e)
            newer = []
        if newer:
            self._lose(f"a newer driver took the lease (epoch {newer[-1]} > {self.epoch})", True)
        self._lapsed()
        if self.lost.is_set():
            raise self.lost_error()

    def lost_error(self) -> FencedError | LeaseLost:
        """Why the lease is lost: FencedError when a newer driver took it (looked up again now: a
        paused holder first finds its TTL run out, then the successor's epoch), else LeaseLost
        (its renewals failed for the TTL: the store was out of reach or this process paused)."""
        if not self.lost_to_newer:
            try:
                newer = [e for e in self._epochs() if e > (self.epoch or 0)]
            except Exception:  # noqa: BLE001 - the store is still out of reach: LeaseLost
                newer = []
            if newer:
                self.lost_to_newer = True
                self.lost_reason = f"a newer driver took the lease (epoch {newer[-1]} > {self.epoch})"
        return (FencedError if self.lost_to_newer else LeaseLost)(self.lost_reason)

    def _lose(self, reason: str, newer: bool = False) -> None:
        if not self.lost.is_set():
            log.warning("lease epoch %s of %s lost: %s", self.epoch, self.url, reason)
        self.lost_reason = reason
        self.lost_to_newer = self.lost_to_newer or newer
        self.lost.set()

    def release(self) -> None:
        """Mark the record released (kept, so epoch numbers keep growing); never a newer one.
        Best effort: when the store cannot be reached, successors wait for the lapse instead."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(min(5.0, self.ttl_s))
            if self._thread.is_alive():
                log.warning("a lease renewal is still in flight; epoch %s is left to lapse", self.epoch)
                return
        if self.epoch is None or self.lost.is_set():
            return
        try:
            found = self._read(self.epoch)
            if found and found[1].get("token") == self.token and self._epochs()[-1:] == [self.epoch]:
                data = json.dumps({**found[1], "released": time.time()}).encode()
                store_call(f"releasing {self._path(self.epoch)}",
                           lambda: write_whole(self.fs, self._path(self.epoch or 0), data))
        except StoreUnavailable as e:
            log.warning("%s; the lease of epoch %s is left to lapse", e, self.epoch)

    def __enter__(self) -> DriverLease:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
