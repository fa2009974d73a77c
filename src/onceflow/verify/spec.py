"""What ``onceflow verify`` runs: a pipeline of consecutive event ids with checksummed payloads.

Every event ``i`` carries ``payload(i)`` (32 hex characters derived from ``i``) and
``crc32(payload(i))``. The independent check recomputes both from the id alone, so a row
that reached the sink with another row's payload, a truncated payload or a wrong checksum is
*corrupted*, whatever the sink did to it.

The spec is JSON in a file named by ``ONCEFLOW_VERIFY_SPEC``, so ``onceflow run`` can start
(and restart, on any host) :mod:`onceflow.verify.job` unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from dataclasses import asdict, dataclass, field

from onceflow.errors import ConfigError
from onceflow.settings import setting

SOURCES = ("sequence", "kafka")
#: sink kinds; ``delta`` is the Delta sink's Arrow write path, ``delta-jvm`` its JVM write path
#: (what ``DeltaSink(path)`` runs for a local table in a Job); ``kafka-at_least_once`` is the
#: deliberately non-exactly-once control; the ``*-upsert`` sinks upsert on ``key = id % K``
#: (:func:`upsert_keys`) ordered by id, deleting where :data:`UPSERT_DELETE_SQL` holds
SINKS = ("delta", "delta-jvm", "delta-upsert", "postgres-two_phase", "postgres-idempotent", "kafka",
         "kafka-at_least_once", "iceberg", "iceberg-upsert")
SALT = "onceflow-verify-"
#: the ``delete_when`` of the ``*-upsert`` sinks: a key whose last event satisfies it must be absent
UPSERT_DELETE_EVERY = 11
UPSERT_DELETE_SQL = f"id % {UPSERT_DELETE_EVERY} = 0"


def upsert_keys(events: int) -> int:
    """K, the number of keys of the ``*-upsert`` sinks (``key = id % K``): several events per key in
    every batch, so each batch rewrites rows of every key and deduplicates within itself."""
    return max(1, min(5000, events // 4))


def payload(event_id: int) -> str:
    """The payload event ``event_id`` must arrive with."""
    return hashlib.sha256(f"{SALT}{event_id}".encode()).hexdigest()[:32]


def checksum(text: str) -> int:
    """CRC-32 of a payload, as Spark's ``crc32`` computes it."""
    return zlib.crc32(text.encode())


@dataclass
class VerifySpec:
    """One verify run's pipeline. ``name`` makes tables, topics and sink ids unique per run."""

    workdir: str
    name: str
    source: str = "sequence"
    sink: str = "delta"
    events: int = 100_000
    rate: int = 10_000
    partitions: int = 2
    master: str = "local[2]"
    postgres: str | None = None
    #: the DSN the job uses when verify's fault proxy stands between it and PostgreSQL
    postgres_job: str | None = None
    kafka: str | None = None
    checkpoint_dir: str | None = None
    spark_conf: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ConfigError(f"verify: unknown source {self.source!r}; choose one of {', '.join(SOURCES)}")
        if self.sink not in SINKS:
            raise ConfigError(f"verify: unknown sink {self.sink!r}; choose one of {', '.join(SINKS)}")
        if self.sink.startswith("postgres") and not self.postgres:
            raise ConfigError(f"verify: sink {self.sink} needs --postgres DSN (a database where "
                              "onceflow may create a table)")
        if (self.sink.startswith("kafka") or self.source == "kafka") and not self.kafka:
            raise ConfigError("verify: a Kafka source or sink needs --kafka BOOTSTRAP_SERVERS")

    # ---- locations ---------------------------------------------------------------------------

    @property
    def checkpoint(self) -> str:
        return self.checkpoint_dir or os.path.join(self.workdir, "checkpoint")

    @property
    def table(self) -> str:
        """Delta path, PostgreSQL table or Kafka topic the sink writes."""
        if self.sink.startswith("delta"):
            return os.path.join(self.workdir, "table")
        if self.sink.startswith("postgres"):
            return f"onceflow_verify_{self.name}"
        if self.sink.startswith("iceberg"):
            return f"verify.t_{self.name}"
        return f"onceflow-verify-out-{self.name}"

    @property
    def release_file(self) -> str:
        """Created once every fault is injected and recovered from: the sequence source then
        makes the rest of the stream available at once (a Kafka source's events are all in
        the topic from the start, read at ``rate`` per batch as before)."""
        return os.path.join(self.workdir, "release-the-stream")

    @property
    def iceberg_catalog(self) -> str:
        """The Iceberg sinks' embedded catalog: an SQLite file in the work directory."""
        return f"sqlite:///{os.path.join(self.workdir, 'iceberg', 'catalog.db')}"

    @property
    def input_topic(self) -> str:
        return f"onceflow-verify-in-{self.name}"

    @property
    def sink_id(self) -> str:
        return f"verify{self.name}"

    # ---- persistence -------------------------------------------------------------------------

    def save(self) -> str:
        path = os.path.join(self.workdir, "spec.json")
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)
        return path

    @classmethod
    def from_env(cls) -> VerifySpec:
        path = setting("ONCEFLOW_VERIFY_SPEC")
        if not path:
            raise ConfigError("ONCEFLOW_VERIFY_SPEC is not set: the verify job is started by "
                              "'onceflow verify', not by hand")
        with open(path) as f:
            return cls(**json.load(f))


@dataclass
class Options:
    """How faults are chosen and shaped (see ``onceflow verify --help``)."""

    faults: list[str] = field(default_factory=lambda: ["driver_kill"])
    count: int = 3
    seed: int | None = None
    gap: tuple[float, float] = (2.0, 6.0)
    outage_s: float = 25.0
    slow_s: float = 3.0
    skew_s: float = 300.0
    pg_stop: str | None = None
    pg_start: str | None = None
    broker_stop: str | None = None
    broker_start: str | None = None
    checkpoint_fs: str | None = None
    lease_ttl_s: float = 6.0
    recovery_timeout: float = 180.0
    standby: bool = True
    wait_standby: bool = True
