"""User-facing errors. Every message says what is wrong and what to do."""

from __future__ import annotations


class OnceflowError(Exception):
    """Base class: a problem the user can act on (printed as one line, no stack trace)."""


class ConfigError(OnceflowError):
    """A wrong or unknown option, or an unusable path."""


class CheckpointError(OnceflowError):
    """The checkpoint directory is missing, unwritable or corrupt."""


class FingerprintMismatch(OnceflowError):
    """The sink already committed this (lineage, batch) with different source offsets."""


class FencedError(OnceflowError):
    """Another driver holds the fence for this lineage."""


class SinkError(OnceflowError):
    """The sink system refused or cannot be reached."""


class InjectedCrash(RuntimeError):
    """Raised by a fault-injection point configured for tests (never in production)."""
