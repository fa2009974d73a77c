"""The commit-time lease check of a query that can outlive its driver (Spark Connect)."""

from __future__ import annotations

from onceflow.checkpoint.lease.holder import DriverLease
from onceflow.checkpoint.lease.identity import clock
from onceflow.checkpoint.lease.sighting import held_s, see_persisted
from onceflow.errors import DriverLeaseLapsed, FencedError


def check_driver_lease(checkpoint_url: str, epoch: int, ttl_s: float) -> None:
    """For a query that can outlive its driver (started over Spark Connect, it runs on the
    server when the client is gone): FencedError when a newer driver took the lease,
    DriverLeaseLapsed when the driver of ``epoch`` released it or this host has seen its
    record go without a renewal for the driver's TTL plus one renewal period, on this host's
    own clock (never by comparing the driver's clock with this one: any skew is fine).
    Called before each batch's decision, so such a query stops committing within about a TTL
    of its driver's death, counted from the first commit that saw the driver's last renewal
    or, sooner, from what the record's ``held_s`` proves (see :mod:`.sighting`).
    StoreUnavailable when the checkpoint store cannot be read (an outage, not fatal)."""
    lease = DriverLease(checkpoint_url, "?", ttl_s=ttl_s)
    read_at = clock()
    epochs = lease._epochs()
    if epochs and epochs[-1] > epoch:
        raise FencedError(f"a newer driver took the lease of {checkpoint_url} (epoch {epochs[-1]} > "
                          f"{epoch}): this query, started by the driver of epoch {epoch}, stops")
    found = lease._read(epoch)
    rec = found[1] if found else None
    quiet = lapse = 0.0
    if found is not None and not rec.get("released"):
        seen, now = see_persisted(lease.url, epoch, found[0], held_s(rec), read_at)
        quiet, lapse = seen.silent_s(held_s(rec), now), lease.lapse_s(rec)
    if rec is None or rec.get("released") or quiet >= lapse:
        who = f"pid {rec.get('pid')} on {rec.get('host')}" if rec else "its driver"
        raise DriverLeaseLapsed(
            f"the driver that started this query ({who}, lease epoch {epoch} of {checkpoint_url}) "
            + ("released its lease" if rec and rec.get("released") else
               "left no lease record" if rec is None else
               f"has not renewed its lease for {quiet:.0f}s by this host's clock (TTL {ttl_s:g}s)")
            + ": it died or is paused, so the query stops instead of committing without it; "
            "'onceflow run' resumes it from the checkpoint")
