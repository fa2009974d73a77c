"""Independent exactly-once checks on what a sink committed.

Reads the committed output directly (not through onceflow) and reports expected, committed,
duplicates and missing ids, plus, for the running-count demo, whether every key's counts
are exactly 1..n in id order (the state was affected once per event).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from onceflow.extras import require


@dataclass
class Report:
    expected: int
    committed: int
    distinct: int
    duplicates: int
    missing: int
    unexpected: int
    state_errors: int = 0
    corrupted: int = 0
    sample_corrupted: list[int] = field(default_factory=list)
    sample_missing: list[int] = field(default_factory=list)
    sample_duplicates: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.duplicates == 0 and self.missing == 0 and self.unexpected == 0 and self.state_errors == 0
                and self.corrupted == 0)


def check_ids(ids: np.ndarray, expected: int) -> Report:
    """Every id in ``range(expected)`` exactly once, nothing else."""
    ids = np.asarray(ids, dtype=np.int64)
    in_range = ids[(ids >= 0) & (ids < expected)]
    counts = np.bincount(in_range, minlength=expected)
    dup_ids = np.flatnonzero(counts > 1)
    missing_ids = np.flatnonzero(counts == 0)
    return Report(
        expected=expected,
        committed=int(ids.size),
        distinct=int(np.count_nonzero(counts)),
        duplicates=int((counts[counts > 1] - 1).sum()),
        missing=int(missing_ids.size),
        unexpected=int(ids.size - in_range.size),
        sample_missing=missing_ids[:10].tolist(),
        sample_duplicates=dup_ids[:10].tolist(),
    )


def check_running_counts(table: pa.Table) -> int:
    """Rows whose ``running_count`` is not its rank by id within its key (0 when state is exact)."""
    if "running_count" not in table.column_names or table.num_rows == 0:
        return 0
    order = np.lexsort((table.column("id").to_numpy(), table.column("key").to_numpy()))
    keys = table.column("key").to_numpy()[order]
    counts = table.column("running_count").to_numpy()[order]
    starts = np.r_[0, np.flatnonzero(np.diff(keys)) + 1]
    rank = np.arange(keys.size) - np.repeat(starts, np.diff(np.r_[starts, keys.size])) + 1
    return int(np.count_nonzero(rank != counts))


def check_delta_table(path: str, expected: int, storage_options: dict | None = None) -> Report:
    """Read a Delta table with delta-rs and check its ``id`` column (and running counts)."""
    require("delta", "reading a Delta table back")
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    from onceflow.storage import delta_target

    url, options = delta_target(path, storage_options)
    try:
        table = DeltaTable(url, storage_options=options).to_pyarrow_table()
    except TableNotFoundError:  # nothing was ever committed
        return check_ids(np.empty(0, dtype=np.int64), expected)
    report = check_ids(table.column("id").to_numpy(), expected)
    report.state_errors = check_running_counts(table)
    return report


def check_upserts(table: pa.Table, events: int, keys: int, delete_every: int, decided: list[int]) -> Report:
    """The ``*-upsert`` check: ``key = id % keys`` upserted in id order, a key whose last
    event id is a multiple of ``delete_every`` deleted. Every other key's row must be its last
    event (``state_errors``: stale rows, plus batches that ``decided`` (the snapshot history)
    shows applied twice or never), present once (``duplicates``, ``missing``); deleted or
    unknown keys absent (``unexpected``); payloads their ids' (``corrupted``)."""
    ks = np.arange(min(keys, events), dtype=np.int64)
    last = ks + keys * ((events - 1 - ks) // keys)
    alive = last % delete_every != 0
    got_keys = table.column("key").to_numpy(zero_copy_only=False).astype(np.int64)
    got_ids = table.column("id").to_numpy(zero_copy_only=False).astype(np.int64)
    known = (got_keys >= 0) & (got_keys < ks.size)
    counts = np.bincount(got_keys[known], minlength=ks.size)
    resurrected = known & ~alive[np.where(known, got_keys, 0)]
    stale = known & ~resurrected & (got_ids != last[np.where(known, got_keys, 0)])
    seen = np.bincount(np.asarray(decided, dtype=np.int64), minlength=1) if decided else np.zeros(0, np.int64)
    history = int((seen[seen > 1] - 1).sum()) + int(np.count_nonzero(seen == 0))
    missing = np.flatnonzero(alive & (counts == 0))
    report = Report(
        expected=int(alive.sum()), committed=int(table.num_rows), distinct=int(np.count_nonzero(counts)),
        duplicates=int((counts[counts > 1] - 1).sum()), missing=int(missing.size),
        unexpected=int(np.count_nonzero(~known) + np.count_nonzero(resurrected)),
        state_errors=int(np.count_nonzero(stale)) + history,
        sample_missing=missing[:10].tolist(), sample_duplicates=np.flatnonzero(counts > 1)[:10].tolist(),
    )
    report.corrupted, report.sample_corrupted = _corrupted(table)
    return report


def _corrupted(table: pa.Table) -> tuple[int, list[int]]:
    from onceflow.verify.spec import checksum, payload

    bad = [
        i for i, p, c in zip(table.column("id").to_pylist(), table.column("payload").to_pylist(),
                             table.column("checksum").to_pylist(), strict=True)
        if p is None or c is None or p != payload(i) or c != checksum(p)
    ]
    return len(bad), bad[:10]


def check_events(table: pa.Table, expected: int) -> Report:
    """``check_ids`` on ``table.id``, plus rows whose payload or checksum is not their id's."""
    report = check_ids(table.column("id").to_numpy(), expected)
    report.corrupted, report.sample_corrupted = _corrupted(table)
    return report
