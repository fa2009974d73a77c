"""``onceflow doctor``: check a sink system and state the guarantee each sink mode gives.

* ``--kafka BOOTSTRAP``: reachability, whether read_committed hides aborted transactional
  records (the probe that gates mode exactly_once), the sink's ``transaction_timeout``
  (``--transaction-timeout``) against the broker's ``transaction.max.timeout.ms``, the marker
  topic (``--marker-topic``: cleanup policy, replication), and per mode the guarantee this
  broker allows.
* ``--postgres DSN [--resolve]``: the PostgreSQL sink's checks; ``--resolve`` commits decided
  and rolls back undecided onceflow prepared transactions of stopped jobs.
* ``--delta PATH``: a Delta table's version, partitioning, schema, protocol and table features,
  the onceflow lineages in its recent commits, and task files not yet cleaned up.
* ``--iceberg CATALOG TABLE``: the Iceberg sink's catalog and table (format version, partition
  spec, snapshot count) and the onceflow lineages in its snapshot summaries; read only.
* no option: every registered sink with its modes and their guarantees.

Exit code 1 when a check fails, 0 otherwise.
"""

from __future__ import annotations

import click

from onceflow.errors import OnceflowError

# Sinks' modes for the no-option listing: format -> (option name, modes, options to build one).
_MODES = {
    "onceflow-delta": ("mode", ("append", "complete"), {"path": "/tmp/unused"}),
    "onceflow-postgres": ("mode", ("two_phase", "idempotent"), {"dsn": "host=unused", "table": "unused"}),
    "onceflow-kafka-sink": ("mode", ("exactly_once", "at_least_once"), {"bootstrap_servers": "unused:9092"}),
    "onceflow-iceberg": ("write", ("append",), {"catalog": "sqlite:////tmp/onceflow-unused/c.db", "table": "a.b"}),
}


def _print(name: str, ok: bool, detail: str, warning: bool = False) -> None:
    if ok and warning:
        mark = click.style("warn", fg="yellow")
    else:
        mark = click.style("ok  ", fg="green") if ok else click.style("FAIL", fg="red")
    click.echo(f"  [{mark}] {name}: {detail}")


def _list_guarantees() -> None:
    from onceflow.sinks.registry import SINKS, _load

    for fmt, ref in SINKS.items():
        try:
            cls = _load(ref)
        except (ImportError, AttributeError) as e:
            click.echo(f"{fmt}: not available ({e}; install the matching extra)")
            continue
        click.echo(f"{fmt}:")
        option, modes, base = _MODES.get(fmt, ("mode", (), {}))
        if not modes:
            click.echo(f"  {cls.__doc__.splitlines()[0] if cls.__doc__ else ''}")
            continue
        for mode in modes:
            try:
                text = cls({**base, option: mode}).describe_guarantee()
            except OnceflowError as e:
                text = f"(cannot describe: {e})"
            click.echo(f"  {option}={mode}: {text}")
        if fmt == "onceflow-postgres":  # idempotent upsert has its own guarantee
            from onceflow.sinks.postgres.doctor import guarantees

            click.echo(f"  mode=idempotent write=upsert: {guarantees()[2]}")
        if fmt == "onceflow-delta":
            click.echo("  write=upsert: exactly-once: one MERGE per batch (the last event per key wins, "
                       "deletes delete) committed with the batch's app transaction; a replay merges nothing")
        if fmt == "onceflow-iceberg":
            click.echo(f"  write=upsert: {cls({**base, 'write': 'upsert', 'keys': 'k'}).describe_guarantee()}")


@click.command("doctor")
@click.option("--kafka", "kafka", metavar="BOOTSTRAP",
              help="Check a Kafka cluster for the Kafka sink (host:port[,host:port]).")
@click.option("--postgres", "postgres", metavar="DSN", help="Check a PostgreSQL server for the PostgreSQL sink.")
@click.option("--delta", "delta", metavar="PATH", multiple=True,
              help="Report a Delta table (repeatable): partitioning, schema, protocol features, onceflow lineages.")
@click.option("--iceberg", "iceberg", nargs=2, metavar="CATALOG TABLE", default=None,
              help="Check an Iceberg catalog (sqlite:///path/catalog.db, postgresql+psycopg://..., or a "
                   "JSON object of pyiceberg properties) and table (namespace.name) for the Iceberg sink.")
@click.option("--warehouse", default=None,
              help="With --iceberg: the catalog's warehouse (required for PostgreSQL; an object-store URL "
                   "is read with ONCEFLOW_STORAGE_OPTIONS, as the sink reads it).")
@click.option("--resolve", is_flag=True,
              help="With --postgres: commit decided / roll back undecided onceflow prepared transactions.")
@click.option("--timeout", default=20.0, show_default=True, metavar="SECONDS",
              help="Timeout of each Kafka check.")
@click.option("--transaction-timeout", "transaction_timeout", default=60.0, show_default=True,
              metavar="SECONDS", help="With --kafka: the Kafka sink's transaction_timeout to check "
              "against the broker's transaction.max.timeout.ms.")
@click.option("--marker-topic", "marker_topic", default="__onceflow_markers", show_default=True,
              help="With --kafka: the Kafka sink's marker topic to check.")
@click.pass_context
def doctor(ctx: click.Context, kafka: str | None, postgres: str | None, delta: tuple[str, ...],
           iceberg: tuple[str, str] | None, warehouse: str | None, resolve: bool, timeout: float,
           transaction_timeout: float, marker_topic: str) -> None:
    """Check sink systems and print the guarantee of every sink mode."""
    if resolve and not postgres:
        raise click.UsageError("--resolve needs --postgres DSN")
    failed = False
    if not kafka and not postgres and not delta and not iceberg:
        _list_guarantees()
        return
    for path in delta:
        from onceflow.sinks.delta.doctor import doctor as delta_doctor

        click.echo(f"Delta table {path}:")
        for check in delta_doctor(path):
            _print(check.name, check.ok, check.detail)
            failed |= not check.ok
    if iceberg:
        try:
            from onceflow.sinks.iceberg.doctor import doctor as iceberg_doctor
        except ImportError as e:
            raise click.UsageError(f"--iceberg needs pyiceberg ({e}): pip install 'onceflow[iceberg]'") from None

        click.echo(f"Iceberg table {iceberg[1]}:")
        for check in iceberg_doctor(iceberg[0], iceberg[1], warehouse):
            _print(check.name, check.ok, check.detail)
            failed |= not check.ok
    if kafka:
        from onceflow.sinks.kafka import doctor as kafka_doctor

        click.echo(f"Kafka at {kafka}:")
        for check in kafka_doctor(kafka, timeout, transaction_timeout, marker_topic):
            _print(check.name, check.ok, check.detail, check.warning)
            failed |= not check.ok
    if postgres:
        from onceflow.sinks.postgres import mask_dsn
        from onceflow.sinks.postgres.doctor import doctor as pg_doctor
        from onceflow.sinks.postgres.doctor import resolve as pg_resolve

        try:
            click.echo(f"PostgreSQL at {mask_dsn(postgres)}:")
            checks = pg_doctor(postgres)
            for check in checks:
                _print(check.name, check.ok, check.detail)
            if resolve and checks[0].ok:
                report = pg_resolve(postgres)
                _print("resolve", report.ok,
                       f"committed {report.committed}, rolled back {report.rolled_back}, "
                       f"merged {report.merged} upsert batch(es)"
                       + (f"; skipped: {'; '.join(report.skipped)}" if report.skipped else ""))
                failed |= not report.ok
                # what resolve fixed is no longer a failure: judge the dangling check afresh
                dangling = "dangling_prepared_transactions"
                again = pg_doctor(postgres)  # the first check instead if the server went away meanwhile
                after = next((c for c in again if c.name == dangling), again[0])
                _print(f"{dangling} after resolve", after.ok, after.detail)
                checks = [after if c.name == dangling else c for c in checks]
            failed |= any(not c.ok for c in checks)
        except OnceflowError as e:
            click.echo(f"  [{click.style('FAIL', fg='red')}] {e}")
            failed = True
    ctx.exit(1 if failed else 0)
