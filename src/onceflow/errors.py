"""User-facing errors. Every message says what is wrong and what to do.

Each class carries ``fatal``: True when a restart cannot fix it (wrong configuration, a
fingerprint mismatch, a driver fenced by a successor), False when it is an outage that the
restart strategy waits out (a sink or broker unreachable). The runner and the supervisor
decide by this attribute, never by matching message text.
"""

from __future__ import annotations


class OnceflowError(Exception):
    """Base class: a problem the user can act on (printed as one line, no stack trace)."""

    fatal: bool = True


class ConfigError(OnceflowError):
    """A wrong or unknown option, or an unusable path."""


class CheckpointError(OnceflowError):
    """The checkpoint directory is missing, unwritable or corrupt."""


class FingerprintMismatch(OnceflowError):
    """The sink already committed this (lineage, batch) with different source offsets."""


class ReplayMismatch(FingerprintMismatch):
    """A replayed task read other rows than the attempt that committed its partition."""


class FencedError(OnceflowError):
    """A newer driver incarnation holds the fence (epoch or lease) for this lineage.

    Raised by every decide/commit of an older epoch; the driver that gets it stops its query
    and exits as fenced (it is not restarted while the newer one holds the lease).
    """


class SinkError(OnceflowError):
    """The sink system refused or cannot be reached (an outage: restarted, not fatal)."""

    fatal = False


class SourceError(OnceflowError):
    """The source system cannot be reached (an outage: restarted, not fatal)."""

    fatal = False


class JvmDied(OnceflowError):
    """The driver's Spark JVM is gone while its Python process lives: restart the process."""

    fatal = False


class SparkUnavailable(OnceflowError):
    """The Spark Connect server cannot be reached (an outage: restarted, not fatal)."""

    fatal = False


class DriverLeaseLapsed(OnceflowError):
    """A query committed without its driver: the driver's lease lapsed (it died or is paused).

    Only queries that can outlive their driver get it: those started over Spark Connect run
    on the server when the client process is gone. Not fatal: a live driver restarts it."""

    fatal = False


class GaveUp(OnceflowError):
    """The restart strategy gave up after repeated query failures."""


class StoreUnavailable(OnceflowError):
    """A store (the checkpoint's filesystem or object store) failed to answer: an outage.

    Not fatal: whoever gets it waits and retries (one log line per attempt) or lets the
    restart strategy do so. ``cause`` is the storage library's own exception."""

    fatal = False

    def __init__(self, message: str, cause: BaseException | None = None):
        super().__init__(message)
        self.cause = cause


class LeaseLost(OnceflowError):
    """The driver's lease lapsed without a newer holder: its renewals failed for the TTL (the
    store was unreachable, or this process was paused). Not fatal: the driver process stops
    its query and exits as crashed; the next one takes the lease again once the store answers
    (a newer holder, had one come, would fence it)."""

    fatal = False


class InjectedCrash(RuntimeError):
    """Raised by a fault-injection point configured for tests (never in production)."""


#: Exception class names that, found in a Spark failure's text, carry an onceflow error
#: raised inside Spark (a task or the commit runner) -> the class to re-raise in the driver.
BY_NAME: dict[str, type[OnceflowError]] = {
    c.__name__: c for c in (ConfigError, CheckpointError, FingerprintMismatch, ReplayMismatch, FencedError, SinkError, SourceError,
                                 DriverLeaseLapsed, StoreUnavailable)
}


# ---- exit codes of a driver process (``python -m onceflow.runtime.driver``), read by the
# supervisor and returned by ``onceflow run``; here so that every layer may name them.
EXIT_OK = 0  #: finished, or stopped on request
EXIT_CRASHED = 1  #: an outage the driver could not wait out in-process: restart per strategy
EXIT_CONFIG = 2  #: a configuration or user error: not restarted
EXIT_GAVE_UP = 3  #: the in-process restart strategy gave up: not restarted
EXIT_SAVEPOINT_FAILED = 4  #: stopped on request, but the savepoint could not be taken
EXIT_FENCED = 5  #: a newer driver took over this lineage: not restarted while it holds the lease
EXIT_JVM_DIED = 70  #: the Spark JVM died under a live driver: restarted like a crash
EXIT_FORCED = 130  #: stopped by a second SIGINT: the in-flight batch was abandoned (replayed next run)
