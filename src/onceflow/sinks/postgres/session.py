"""Connections of the PostgreSQL sink: reuse, retries, and one-line errors without the password.

Guarantees: every connection is autocommit, has TCP keepalives on, and carries an
application_name: ``of:<tag>:e<epoch>:<role>`` (role ``driver`` or ``task``) when it works for
one (sink, lineage), which is how a new epoch finds and terminates an older driver's sessions
(:mod:`.fence`), else ``onceflow-<role>`` (validate, open, doctor). An idle connection is kept
per (server, credentials, thread) and reused; it goes back for reuse only when its block
succeeded and left no transaction open, and is renamed when reused for another lineage or
epoch. :meth:`Sessions._retrying` retries a failed or dropped connection with back-off until
``commit_deadline`` (one warning line per retry: what failed, why, when it is tried again),
then raises SinkError (an outage: the restart strategy waits it out); a
server that refuses the credentials or the database raises ConfigError at once. Messages name
``host:port/db`` on one line, never the password.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import TypeVar

import psycopg
from psycopg.pq import TransactionStatus
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from onceflow.errors import ConfigError, SinkError
from onceflow.sinks.postgres.dsn import FORMAT, scrub
from onceflow.sinks.postgres.fence import app_name

log = logging.getLogger("onceflow.sinks.postgres")
_R = TypeVar("_R")
#: idle connections kept for reuse, one per (server, credentials, thread) in this process
_IDLE: dict[tuple[str, str | None, int], psycopg.Connection] = {}
_REFUSED = re.compile(r"authentication|does not exist|no pg_hba|permission denied|role ")


class Sessions:
    """Connection handling of :class:`~onceflow.sinks.postgres.source.PostgresDataSource`."""

    conninfo: str
    password: str | None
    where: str
    sink_id: str
    connect_timeout: int
    commit_deadline: float
    epoch: int | None

    def _name(self, role: str, lineage: str | None, epoch: int | None) -> str:
        """``of:<tag>:e<epoch>:<role>`` for a lineage (role ``driver`` or ``task``, so that one
        connection keeps its name across calls), else ``onceflow-<role>``."""
        if lineage is None:
            return f"onceflow-{role}"
        return app_name(self.sink_id, lineage, self.epoch if epoch is None else epoch, role)

    def _connect(self, role: str, lineage: str | None = None, epoch: int | None = None) -> psycopg.Connection:
        """A new autocommit connection (raises psycopg.OperationalError: see :meth:`_connect_error`)."""
        return psycopg.connect(
            self.conninfo, password=self.password, autocommit=True, connect_timeout=self.connect_timeout,
            application_name=self._name(role, lineage, epoch),
            keepalives=1, keepalives_idle=10, keepalives_interval=5, keepalives_count=3,
        )

    def _connect_error(self, e: psycopg.OperationalError) -> ConfigError | SinkError:
        """The server refused us (ConfigError: fix the DSN) or is not reachable (SinkError: retry)."""
        text = self._safe(e)
        if _REFUSED.search(text):
            return ConfigError(f"{FORMAT}: PostgreSQL at {self.where} refused the connection ({text}); check database, user and password")
        return SinkError(f"{FORMAT}: PostgreSQL at {self.where} unreachable ({text}); check host and port, or wait until the server is up")

    def _safe(self, e: BaseException) -> str:
        return scrub(str(e), self.password)

    def _retry(self, purpose: str) -> Retrying:
        """Retries of ``purpose`` until commit_deadline, one warning line per retry."""

        def before_sleep(state) -> None:
            first = self._safe(state.outcome.exception()).strip().splitlines() or ["?"]
            log.warning("%s: %s at %s failed (%s); retry %d in %.1f s (gives up after commit_deadline, %gs)",
                        FORMAT, purpose, self.where, first[0][:200], state.attempt_number,
                        state.next_action.sleep, self.commit_deadline)

        return Retrying(
            retry=retry_if_exception_type(psycopg.OperationalError),
            stop=stop_after_delay(self.commit_deadline),
            wait=wait_exponential(multiplier=0.2, max=3),
            before_sleep=before_sleep,
            reraise=True,
        )

    def _unreachable(self, purpose: str, e: psycopg.OperationalError) -> SinkError:
        return SinkError(
            f"{FORMAT}: {purpose} failed: PostgreSQL at {self.where} unreachable for "
            f"{self.commit_deadline:g}s ({self._safe(e)}); restart the query when it is back: "
            "a decided batch is committed by recovery, an undecided one is replayed"
        )

    @contextmanager
    def _session(self, role: str, lineage: str | None = None, epoch: int | None = None) -> Iterator[psycopg.Connection]:
        """An autocommit connection, reused across calls in this process (one per thread).

        It goes back for reuse only when the block succeeded and left no transaction open; after
        any error it is closed, which also drops session-level advisory locks it may hold.
        A reused connection that the server dropped meanwhile (or that a newer epoch terminated)
        fails its first statement with OperationalError, which :meth:`_retrying` answers with a
        fresh connection. A refused connection raises ConfigError (not retried).
        """
        key = (self.conninfo, self.password, threading.get_ident())
        name = self._name(role, lineage, epoch)
        conn = _IDLE.pop(key, None)
        if conn is None or conn.closed:
            try:
                conn = self._connect(role, lineage, epoch)
            except psycopg.OperationalError as e:
                if isinstance(err := self._connect_error(e), ConfigError):
                    raise err from None
                raise
        reusable = False
        try:
            if conn.info.parameter_status("application_name") != name:
                conn.execute("SELECT set_config('application_name', %s, false)", [name])
            yield conn
            reusable = not conn.closed and conn.info.transaction_status == TransactionStatus.IDLE
        finally:
            if reusable:
                _IDLE[key] = conn
            else:
                conn.close()

    def _retrying(self, purpose: str, fn: Callable[[psycopg.Connection], _R], lineage: str | None = None,
                  role: str = "driver", epoch: int | None = None) -> _R:
        """Run ``fn`` on a session (see :meth:`_session`); retry connection failures until
        commit_deadline, then raise SinkError naming ``purpose``."""
        try:
            for attempt in self._retry(purpose):
                with attempt, self._session(role, lineage, epoch) as conn:
                    return fn(conn)
        except psycopg.OperationalError as e:
            raise self._unreachable(purpose, e) from None
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close this process's idle connections to the server (they are reopened on demand)."""
        for key in [k for k in _IDLE if k[:2] == (self.conninfo, self.password)]:
            with suppress(psycopg.Error):
                _IDLE.pop(key).close()
