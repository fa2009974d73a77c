"""User-facing configuration of the PostgreSQL sink: :class:`PostgresSink`.

Guarantees: :meth:`PostgresSink.options` gives the Spark options of ``onceflow-postgres`` with
the password moved out of the DSN into the ``password`` option (which Spark redacts in plans and
logs); ``repr``/``str`` show the DSN with the password masked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from onceflow.sinks.base import Sink
from onceflow.sinks.postgres.dsn import FORMAT, mask_dsn, split_dsn


@dataclass(repr=False)
class PostgresSink(Sink):
    """Exactly-once PostgreSQL sink for a :class:`~onceflow.Job` (or ``writeStream``).

    ``mode``: ``two_phase`` (atomic batches, needs max_prepared_transactions > 0, one slot per
    write partition) or ``idempotent`` (rows + marker per task; an append batch can be partly
    visible for a moment). ``write``: ``append`` or ``upsert`` on ``keys`` (staged by the tasks,
    merged atomically by the driver; within a batch the last row per key in (partition,
    position) order wins). ``commit_deadline``: seconds a commit keeps
    retrying an unreachable server before the query fails (recovery finishes it later).
    ``lock_timeout``: seconds a task's transaction waits for a lock (a dead task's or a zombie
    driver's prepared rows, say) before the task fails with a SinkError and is retried; the
    retry rolls back undecided prepared transactions of older epochs and of the partition's
    other attempts.
    """

    dsn: str
    table: str
    mode: Literal["two_phase", "idempotent"] = "two_phase"
    write: Literal["append", "upsert"] = "append"
    keys: tuple[str, ...] | list[str] = field(default_factory=tuple)
    create_table: bool = False
    commit_deadline: float = 60.0
    sink_id: str = "postgres"
    lock_timeout: float = 10.0

    format_name = FORMAT

    def options(self) -> dict[str, str]:
        conninfo, password = split_dsn(self.dsn)
        opts = {
            "dsn": conninfo, "table": self.table, "mode": self.mode, "write": self.write,
            "create_table": str(bool(self.create_table)).lower(),
            "commit_deadline": str(self.commit_deadline), "sink_id": self.sink_id,
            "lock_timeout": str(self.lock_timeout),
        }
        if self.keys:
            opts["keys"] = ",".join([self.keys] if isinstance(self.keys, str) else self.keys)
        if password:
            opts["password"] = password
        return opts

    def __repr__(self) -> str:
        return (
            f"PostgresSink(dsn={mask_dsn(self.dsn)!r}, table={self.table!r}, mode={self.mode!r}, "
            f"write={self.write!r}, keys={tuple(self.keys)!r}, sink_id={self.sink_id!r})"
        )

    __str__ = __repr__
