"""Exactly-once PostgreSQL sink on psycopg 3 (docs/protocol.md).

Modes and their guarantees:

* ``two_phase`` (default; needs ``max_prepared_transactions`` > 0): each task COPYs its
  partition inside a transaction and ``PREPARE TRANSACTION``\\ s it under a global id
  ``onceflow:<sink>:<lineage>:<batch>:<partition>:<attempt>:e<epoch>:<run>``. The driver
  records the decision (batch, fingerprint, gids, epoch) in the onceflow commit log, then
  ``COMMIT PREPARED``\\ s every gid. **Exactly-once, and a batch becomes visible as a whole**
  (modulo the instants between the individual COMMIT PREPARED statements of one batch).
* ``idempotent`` (for servers without prepared transactions): each task writes its rows and a
  (sink, lineage, batch, partition) marker in one local transaction; a replayed task that
  finds its marker writes nothing. **Exactly-once effect, weaker visibility** (append): a batch
  becomes visible partition by partition, and a failed batch can stay partly visible until it
  is replayed (always the next thing the same lineage does).

Write kinds: ``append`` (tasks COPY into the table inside their prepared/local transaction)
and ``upsert`` on declared key columns, staged by the tasks and merged by the driver in one
statement per decided batch, the last row per key in (partition, position) order winning
(:mod:`.stage`): in both modes **an upsert batch becomes visible atomically**.

**Fencing** (:mod:`.fence`): every driver incarnation takes a new epoch for (sink, lineage) in
``onceflow_epochs`` when it opens, terminating every session an older driver of that lineage
still has; a decision is recorded only while the caller's epoch is current. A paused or
partitioned driver that wakes up after a successor opened can therefore never make anything
visible, and never blocks the successor.

Modules: :mod:`.dsn` (DSN and secrets), :mod:`.types` (type mapping, table checks),
:mod:`.copy` (COPY encoder), :mod:`.stage` (upsert staging and merge), :mod:`.fence` (epochs),
:mod:`.session` (connections and retries), :mod:`.source` (the Spark data source and the
driver's protocol steps), :mod:`.task` (a task's pre-commit, its lock timeout), :mod:`.sink` (:class:`PostgresSink`), :mod:`.doctor` (``onceflow doctor --postgres``).
The password (in the DSN or the ``password`` option) never appears in errors, logs or ``repr``.
"""

from onceflow.extras import require

require("postgres", "onceflow's PostgreSQL sink (PostgresSink)")  # one line, before any psycopg import

from onceflow.sinks.postgres.copy import STAGE_COLUMNS, _copy, encode_binary  # noqa: E402
from onceflow.sinks.postgres.dsn import FORMAT, mask_dsn, split_dsn, where  # noqa: E402
from onceflow.sinks.postgres.sink import PostgresSink  # noqa: E402
from onceflow.sinks.postgres.source import GID, PostgresDataSource  # noqa: E402
from onceflow.sinks.postgres.stage import stage_tables  # noqa: E402
from onceflow.sinks.postgres.task import SLOT_RULE  # noqa: E402
from onceflow.sinks.postgres.types import pg_type  # noqa: E402

__all__ = [
    "FORMAT", "GID", "SLOT_RULE", "STAGE_COLUMNS", "PostgresDataSource", "PostgresSink", "_copy",
    "encode_binary", "mask_dsn", "pg_type", "split_dsn", "stage_tables", "where",
]
