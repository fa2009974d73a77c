"""The driver lease on a checkpoint: refuses a second driver early; safety never depends on it.

Guarantee: at most one driver *believes* it holds the lease at any epoch, and a driver that
learns it lost the lease stops its query. Exactly-once does not rest on this package (clocks,
pauses and object-store listings can all lie): the sinks' fencing epochs do. The lease only
makes the common cases (two ``onceflow run`` on one checkpoint, a successor taking over a
dead driver) fast and clear. No decision compares two hosts' clocks.

Layout: one record per holder, ``<checkpoint>/_onceflow/lease/<epoch>.json``, created with an
exclusive create (``open(..., "xb")``: O_EXCL locally, a conditional put on object stores:
s3fs sends ``If-None-Match: *`` and a store that already has the object answers 412, which
s3fs raises as FileExistsError), so two drivers can never hold the same epoch. A filesystem
that cannot create exclusively is refused (ConfigError), never used unsafely. The holder is
the record with the highest epoch. Each holder only ever rewrites its own record, whole (a
rename of a temporary file locally, one PUT on an object store; never an append or a rename
there), so a renewal never overwrites a newer holder. Listings bypass fsspec's listings cache.

A record (format 2) names its holder by host, boot id, PID namespace and process start time
(:mod:`.identity`), and carries a renewal counter and the holder's own elapsed time. Records
of earlier onceflow versions (no ``format``) are still read: they are judged by their
renewals alone. Earlier versions read format 2 records as before (every old field is kept).

* **acquire**: refused while the highest record's holder is alive. A holder in this
  process's own PID namespace on this boot is alive while its process (pid *and* start time)
  runs; any other holder (another host, another container, whatever its host name) is alive
  while its record keeps changing, and lapsed once this process has seen it unchanged for
  the holder's TTL plus one renewal period, on its own monotonic clock (:mod:`.sighting`).
  ``takeover=True`` (the supervisor saw the holder die) skips the test. Otherwise create
  ``<highest+1>.json``; losing that race is a FencedError.
* **renew** (every ``renew_s``): if a higher epoch exists, or no renewal succeeded for
  ``ttl_s`` on the holder's own monotonic clock (default 30 s, or ``ONCEFLOW_LEASE_TTL_S``;
  renewal every ttl/6, or ``ONCEFLOW_LEASE_RENEW_S``), the lease is *lost*:
  :attr:`DriverLease.lost` is set and the runner stops its query (self-fencing). Any error
  of a renewal is logged (one line per attempt) and retried until then; the thread never
  dies silently. Records of older epochs are removed by the new holder; a released record
  is kept (marked released) so epoch numbers only grow.
* **storage errors** reach callers as :class:`onceflow.errors.StoreUnavailable` (not
  fatal), never as a storage library's own exception; :meth:`DriverLease.holder` retries
  them for ``retry_s`` first.

Crash windows: a holder that dies between the exclusive create and writing its record
leaves an empty record, which lapses like a silent holder; a holder paused longer than its
TTL finds itself lost on waking (and a successor may have taken over: the sink epochs fence
whatever it still tries).
"""

from onceflow.checkpoint.lease.commit_check import check_driver_lease
from onceflow.checkpoint.lease.holder import DriverLease, Verdict, store_call

__all__ = ["DriverLease", "Verdict", "check_driver_lease", "store_call"]
