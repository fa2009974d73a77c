"""Savepoints (the savepoint contract): user-owned, relocatable snapshots of a stopped job.

``create_savepoint`` (from a stopped job), ``stop_with_savepoint`` (a job run by
``onceflow run``), ``list_savepoints``, ``inspect_savepoint``, ``dispose_savepoint``, and
``RestoreRequest`` / ``job.run(from_savepoint=...)`` for resume, fork, roll back and rescale.
The format is described in :mod:`onceflow.savepoint.manifest`.
"""

from onceflow.savepoint.create import create_savepoint
from onceflow.savepoint.manifest import Manifest, SavepointError, read_manifest
from onceflow.savepoint.operations import (
    dispose_savepoint,
    inspect_savepoint,
    list_savepoints,
    stop_with_savepoint,
)
from onceflow.savepoint.restore import RestoreRequest, RestoreResult

__all__ = [
    "Manifest", "RestoreRequest", "RestoreResult", "SavepointError", "create_savepoint",
    "dispose_savepoint", "inspect_savepoint", "list_savepoints", "read_manifest",
    "stop_with_savepoint",
]
