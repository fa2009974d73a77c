"""How a reader decides that a lease record lapsed: by what it saw, on its own clock.

Like Kubernetes' leader election, a reader never compares another host's timestamps with its
own clock. It remembers each record's content (a digest: every renewal changes it, a counter
included) and when *it* first saw that content, on :func:`identity.clock`. A record seen
unchanged for the lapse time (the holder's TTL plus one renewal period, so the holder has
given itself up first) has lapsed. Content that changed under the reader's eyes proves the
holder renewed; content seen once and not yet for the lapse time proves nothing either way.

A reader that looks only now and then (the commit-time check of a query run over Spark
Connect, once per batch) also uses the holder's own elapsed time in the record (``held_s``,
measured on the holder's clock when the renewal started): every sighting bounds the moment
the holder took the lease from above (this reader's clock at the sighting minus ``held_s``,
since the write was measured before it could be seen), and the newest record's silence is
then at least ``now - that bound - its held_s``. Only clock *rates* meet there, never clock
readings; a rate tolerance of 0.1 % and a bound renewed every 10 minutes keep that error
under a second. Every error in this direction makes the reader wait longer, never shorter.

Sightings live in this process (shared by every DriverLease of it) and, for the commit-time
check whose Python workers may not live from one batch to the next, in a small file per
(checkpoint, epoch) in the system temporary directory, valid on this boot only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import threading
import time

from onceflow.checkpoint.lease.identity import clock, clock_domain

RATE_TOLERANCE = 1e-3  # two hosts' monotonic clocks run at most this far apart (NTP slews <= 5e-4)
BOUND_HORIZON_S = 600.0  # a bound older than this is replaced by a fresh one (caps the rate error)
_STORE_DIR = "onceflow-lease-sightings"


@dataclasses.dataclass
class Sighting:
    """What one reader knows of one lease record."""

    digest: str  #: of the record's bytes as last read
    first_seen: float  #: this reader's clock when it first saw that content
    changed: bool  #: the content changed while this reader watched: the holder renewed
    origin: float | None = None  #: upper bound of the holder's acquisition on this reader's clock
    origin_at: float | None = None  #: when that bound was taken

    def after(self, digest: str, held_s: float | None, now: float) -> Sighting:
        """This sighting updated with content ``digest`` read ``now``."""
        if digest == self.digest:
            return self
        return _first(digest, held_s, now, changed=True, previous=self)

    def silent_s(self, held_s: float | None, now: float) -> float:
        """Seconds the holder has provably not renewed, on this reader's clock."""
        quiet = now - self.first_seen
        if self.origin is not None and self.origin_at is not None and held_s is not None:
            quiet = max(quiet, now - self.origin - held_s - RATE_TOLERANCE * (now - self.origin_at))
        return quiet


def _first(digest: str, held_s: float | None, now: float, changed: bool = False,
           previous: Sighting | None = None) -> Sighting:
    origin = origin_at = None
    if held_s is not None:
        origin, origin_at = now - held_s, now
        if (previous is not None and previous.origin is not None and previous.origin_at is not None
                and previous.origin <= origin and now - previous.origin_at <= BOUND_HORIZON_S):
            origin, origin_at = previous.origin, previous.origin_at
    return Sighting(digest, now, changed, origin, origin_at)


def digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()[:32]


def held_s(record: dict) -> float | None:
    try:
        return float(record["held_s"]) if "held_s" in record else None
    except (TypeError, ValueError):
        return None


class Sightings:
    """This process's sightings, by (lease directory, epoch)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, int], Sighting] = {}

    def see(self, where: str, epoch: int, raw: bytes, held: float | None,
            read_at: float) -> tuple[Sighting, float]:
        """Record a read of ``raw`` that began at ``read_at`` (this reader's clock); returns the
        sighting and the instant to judge its silence at (``read_at``)."""
        now, d = clock(), digest(raw)
        with self._lock:
            prev = self._seen.get((where, epoch))
            seen = _first(d, held, now) if prev is None else prev.after(d, held, now)
            for key in [k for k in self._seen if k[0] == where and k[1] < epoch]:
                del self._seen[key]  # older epochs are never read again
            self._seen[(where, epoch)] = seen
        return seen, min(read_at, now)


SIGHTINGS = Sightings()


def see_persisted(where: str, epoch: int, raw: bytes, held: float | None,
                  read_at: float) -> tuple[Sighting, float]:
    """Like :meth:`Sightings.see`, kept in a file so that the next process of this host (the
    next batch's Python worker) continues the observation. A missing or foreign file starts
    over (the record counts as just seen: the conservative side)."""
    base = os.path.join(tempfile.gettempdir(), _STORE_DIR)
    path = os.path.join(base, hashlib.sha256(f"{where}#{epoch}".encode()).hexdigest()[:40] + ".json")
    domain, prev = clock_domain(), None
    try:
        with open(path) as f:
            stored = json.load(f)
        if stored.pop("domain", None) == domain:
            prev = Sighting(**stored)
    except (OSError, ValueError, TypeError):
        prev = None
    now, d = clock(), digest(raw)
    seen = _first(d, held, now) if prev is None else prev.after(d, held, now)
    if seen is not prev:
        try:
            os.makedirs(base, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump({**dataclasses.asdict(seen), "domain": domain}, f)
            os.replace(tmp, path)
            _prune(base)
        except OSError:
            pass  # an unwritable temp dir: each check starts over (conservative, never wrong)
    return seen, min(read_at, now)


def _prune(base: str, older_than_s: float = 7 * 86400) -> None:
    """Drop sightings of epochs nobody checked for a week (one file per driver epoch)."""
    cutoff = time.time() - older_than_s
    for name in os.listdir(base):
        try:
            if os.path.getmtime(os.path.join(base, name)) < cutoff:
                os.remove(os.path.join(base, name))
        except OSError:
            pass
