"""The result of one ``onceflow doctor`` check, shared by every sink's doctor."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckResult:
    """One doctor check: ``ok`` False means the user has something to do (``detail`` says what)."""

    name: str
    ok: bool
    detail: str
