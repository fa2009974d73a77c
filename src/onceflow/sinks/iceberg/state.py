"""What the Iceberg sink keeps in the table's metadata, and how it reads it back.

Every commit of the sink is one snapshot on ``main`` whose summary says who made it:

* ``onceflow.sink``, ``onceflow.lineage``, ``onceflow.epoch`` on every one;
* a *decision* (batch N of this lineage, the data files it adds) also has ``onceflow.batch``,
  ``onceflow.fingerprint`` and ``onceflow.files`` (the JSON list of the batch's file names);
* an *epoch* snapshot (a driver opened the sink) adds no files and has no batch.

The same commit sets the table property ``onceflow.<sink>.<lineage>`` to ``{"epoch": E,
"batch": N}``: the lineage's newest epoch and last decided batch. It lives in the same metadata
file as the snapshots, so one read of the table sees both consistently, and it survives
snapshot expiration (``expire_snapshots`` may drop old decisions; a batch whose snapshot is gone
is still known to be decided, only its file list is then unknown). Batches of one lineage are
decided in order, so "batch N is decided" is "N <= the property's batch".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SINK, LINEAGE, EPOCH, BATCH = "onceflow.sink", "onceflow.lineage", "onceflow.epoch", "onceflow.batch"
FINGERPRINT, FILES = "onceflow.fingerprint", "onceflow.files"


def state_key(sink_id: str, lineage: str) -> str:
    """The table property holding (epoch, last decided batch) of (sink, lineage)."""
    return f"onceflow.{sink_id}.{lineage}"


@dataclass(frozen=True)
class LineageState:
    """The newest epoch (None: never opened) and last decided batch (-1: none) of a lineage."""

    epoch: int | None
    batch: int

    def as_property(self) -> str:
        return json.dumps({"epoch": self.epoch, "batch": self.batch})


def lineage_state(metadata: Any, sink_id: str, lineage: str) -> LineageState:
    """(epoch, last batch) of (sink, lineage) in this table metadata; from the property, else
    (a table whose properties were edited by hand) from the snapshot summaries."""
    raw = metadata.properties.get(state_key(sink_id, lineage))
    if raw:
        try:
            value = json.loads(raw)
            return LineageState(value.get("epoch"), int(value.get("batch", -1)))
        except (ValueError, TypeError, AttributeError):
            pass
    epoch, batch = None, -1
    for summary in summaries(metadata, sink_id, lineage):
        epoch = max(epoch or 0, int(summary[EPOCH]))
        if BATCH in summary:
            batch = max(batch, int(summary[BATCH]))
    return LineageState(epoch, batch)


def summaries(metadata: Any, sink_id: str, lineage: str) -> list[dict[str, str]]:
    """The summaries of this (sink, lineage)'s snapshots still in the metadata, newest first."""
    out = []
    for snap in reversed(metadata.snapshots):
        summary = snap.summary.additional_properties if snap.summary is not None else {}
        if summary.get(LINEAGE) == lineage and summary.get(SINK) == sink_id:
            out.append(summary)
    return out


def decision_summary(metadata: Any, sink_id: str, lineage: str, batch_id: int) -> dict[str, str] | None:
    """The summary of the snapshot that decided batch N of this lineage, if it is still there."""
    for summary in summaries(metadata, sink_id, lineage):
        if summary.get(BATCH) == str(batch_id):
            return summary
    return None


def decision_properties(sink_id: str, lineage: str, epoch: int | None, batch_id: int | None = None,
                        fingerprint: str = "", files: list[str] | None = None) -> dict[str, str]:
    """The snapshot summary entries of an epoch snapshot (no batch) or a decision."""
    props = {SINK: sink_id, LINEAGE: lineage, EPOCH: str(epoch)}
    if batch_id is not None:
        props |= {BATCH: str(batch_id), FINGERPRINT: fingerprint, FILES: json.dumps(files or [])}
    return props
