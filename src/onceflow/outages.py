"""Storage and network errors are outages to wait out; only wrong configuration ends a job.

:func:`is_config_error` tells the two apart: a path that cannot be a directory, missing
permissions (wrong credentials), a malformed URL, and onceflow's own fatal errors are
configuration; everything else a filesystem, object store or network client raises (refused
connections, timeouts, HTTP 5xx, a read-only or full filesystem, credentials that expired
before their refresh landed) is an outage. :func:`wait_out` retries a step through any outage, logging one line
per retry that says what waits and why, and raises a configuration error at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from tenacity import Retrying, retry_if_exception, wait_exponential

from onceflow.errors import OnceflowError

T = TypeVar("T")

_CONFIG = (PermissionError, NotADirectoryError, IsADirectoryError, FileExistsError, ValueError,
           TypeError, KeyError)


#: what object stores answer (s3fs raises PermissionError) when short-lived credentials ran out
#: before their refresh landed: a rotated token (a sidecar's, IRSA's, a vault agent's) fixes it
_EXPIRED = ("expiredtoken", "token has expired", "requestexpired", "expired token", "tokenrefreshrequired")


def _expired(e: BaseException) -> bool:
    """The error (or the client error it translates, as s3fs's do) says credentials expired."""
    cause = e.__cause__
    code = str(getattr(cause, "response", {}).get("Error", {}).get("Code", "")).lower()
    return any(m in f"{code} {e}".lower() for m in _EXPIRED)


def is_config_error(e: BaseException) -> bool:
    """True when waiting cannot fix ``e`` (see module doc). Expired credentials are an outage:
    a refresh of short-lived credentials ends it."""
    if isinstance(e, OnceflowError):
        return e.fatal
    if isinstance(e, PermissionError) and _expired(e):
        return False
    return isinstance(e, _CONFIG)


def short(e: BaseException) -> str:
    """``Class: first line`` of an error, for one log line."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


class Stopped(Exception):
    """:func:`wait_out` was stopped (its ``stop`` event was set) before the step succeeded."""


def wait_out(what: str, step: Callable[[], T], log: logging.Logger, *,
             stop: threading.Event | None = None, max_wait_s: float = 10.0) -> T:
    """``step()``, retried through outages (backing off up to ``max_wait_s`` between tries,
    one warning per retry: "<what> failed (<error>); retry N in S s"). A configuration error
    is raised at once; a set ``stop`` ends the wait with :class:`Stopped`."""

    def before_sleep(state) -> None:
        log.warning("%s failed (%s); an outage of the store or the network: retry %d in %.1f s",
                    what, short(state.outcome.exception()), state.attempt_number,
                    state.next_action.sleep)

    def sleep(seconds: float) -> None:
        if stop is not None and stop.wait(seconds):
            raise Stopped(what)
        if stop is None:
            threading.Event().wait(seconds)

    retrying = Retrying(retry=retry_if_exception(lambda e: not is_config_error(e) and not isinstance(e, Stopped)),
                        wait=wait_exponential(multiplier=0.5, max=max_wait_s), sleep=sleep,
                        before_sleep=before_sleep, reraise=True)
    return retrying(step)
