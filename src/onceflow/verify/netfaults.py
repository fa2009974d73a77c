"""Network faults of ``onceflow verify``, through a :class:`~onceflow.verify.proxy.FaultProxy`
between the job and its PostgreSQL.

* ``net_partition``: every connection is reset and new ones are refused for ``--outage-s``
  (longer than the sink's commit deadline and the lease TTL), then the path heals.
* ``lost_reply``: one or two commits (``COMMIT`` of a task's or the decide step's
  transaction, ``COMMIT PREPARED``, a task's ``PREPARE TRANSACTION``) reach PostgreSQL, which acts on them, and their answers
  are dropped with the connection: the job must find out what happened, never redo or undo it.

Only the job goes through the proxy (its spec carries the proxied DSN); verify's own reader
and the dangling check talk to PostgreSQL directly. Kafka and object stores: not proxied yet
(a broker must advertise the proxy's address; verify's Delta table is a local path), and
:meth:`unavailable` says so.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from onceflow.verify.fault_base import Fault, FaultMissed, Harness
from onceflow.verify.proxy import FaultProxy
from onceflow.verify.spec import Options, VerifySpec

PROXIED = ("net_partition", "lost_reply")


def _needs_postgres(h: Harness, name: str) -> str | None:
    if h.spec.sink.startswith("postgres"):
        return None
    return (f"needs a PostgreSQL sink (--sink postgres-two_phase or postgres-idempotent): {name} runs "
            "through a proxy in front of PostgreSQL only; a Kafka broker would have to advertise the "
            "proxy's address, and verify's Delta table is a local path, not an object store")


@contextmanager
def proxies(spec: VerifySpec, options: Options) -> Iterator[dict[str, FaultProxy]]:
    """Start the proxies the faults need and point the job's spec at them (saved again)."""
    found: dict[str, FaultProxy] = {}
    try:
        if any(f in PROXIED for f in options.faults) and spec.sink.startswith("postgres") and spec.postgres:
            from psycopg.conninfo import conninfo_to_dict, make_conninfo  # the verify extra

            params = conninfo_to_dict(spec.postgres)
            host = str(params.get("host") or "127.0.0.1")
            if host.startswith("/"):
                host = "127.0.0.1"  # a socket directory: the proxy speaks TCP to localhost
            proxy = FaultProxy((host, int(params.get("port") or 5432)), "postgres")
            found["postgres"] = proxy
            spec.postgres_job = make_conninfo(spec.postgres, host="127.0.0.1", port=str(proxy.port),
                                              sslmode="disable", gssencmode="disable")
            spec.save()
        yield found
    finally:
        for p in found.values():
            p.close()


class NetPartition(Fault):
    name, help = "net_partition", ("reset every job connection to PostgreSQL and refuse new ones for "
                                   "--outage-s, then heal (a TCP fault proxy)")
    stream_s = 70

    def unavailable(self, h: Harness) -> str | None:
        return _needs_postgres(h, self.name)

    def inject(self, h: Harness) -> str:
        cut, refused = h.proxies["postgres"].partition(h.options.outage_s)
        return (f"PostgreSQL unreachable for {h.options.outage_s:.0f}s: cut {cut} connection(s), "
                f"refused {refused} new one(s)")


class LostReply(Fault):
    name, help = "lost_reply", ("forward a commit to PostgreSQL and drop its answer with the "
                                "connection (the server acted, the job never heard)")
    stream_s = 60

    def unavailable(self, h: Harness) -> str | None:
        return _needs_postgres(h, self.name)

    def inject(self, h: Harness) -> str:
        skips = [h.rng.randint(0, 3) for _ in range(h.rng.randint(1, 2))]
        dropped = h.proxies["postgres"].lose_replies(skips, timeout=max(30.0, h.options.outage_s))
        if not dropped:
            raise FaultMissed("no commit reached PostgreSQL")
        return f"dropped the reply to {len(dropped)} commit(s) PostgreSQL acted on: " + "; ".join(dropped)
