"""The warm standby driver: a second driver process that is ready before it is needed.

A standby is ``python -m onceflow.runtime.driver TARGET`` started with ``ONCEFLOW_STANDBY_GO``
naming a file that does not exist yet. It loads the job, starts its JVM and SparkSession,
registers onceflow's sources and sinks, and runs :func:`warm_up` (a few small streaming batches
into a throwaway Delta table, the imports of the job's sink and source in the Python workers, which
Spark then reuses, and one build of the job's DataFrame, dropped: :func:`plan_job`). It
writes ``<go file>.ready`` (its pid and warm-up time) and waits, running the warm-up (one batch,
without the job's DataFrame) again every :data:`KEEP_WARM_S` so that Spark does not stop its idle
Python workers (:func:`keep_warm`).

When the go file appears (the supervisor creates it the moment it sees the active driver
die), the standby runs the job from the checkpoint like any restarted driver. The go file says
how it takes the lease (:func:`promote`, :func:`takes_over`): *with takeover* when the lease is
held by a driver of its own supervisor, which just died, and only from that driver's lease
epoch (its sinks take a newer fencing epoch, so even a driver that only looked dead can never
commit again; a lease another supervisor took meanwhile is not taken over); otherwise the way any driver
does, standing by while a live driver of another supervisor holds it (a second pod on the same
checkpoint), so that two supervisors never fence each other in turn. An empty go file means
takeover.

Guarantees: a standby never opens a sink, takes the lease or touches the checkpoint before
its go file exists; SIGTERM (or its parent, the supervisor, going away) makes a waiting
standby exit 0 at once. A standby that dies while waiting is replaced by the supervisor.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from onceflow.spark import is_connect

if TYPE_CHECKING:
    from onceflow.runtime.spec import JobSpec

log = logging.getLogger("onceflow.standby")

GO_ENV = "ONCEFLOW_STANDBY_GO"


def _modules(job: JobSpec) -> list[str]:
    """Modules the job's tasks will import: its sink's and onceflow's data sources."""
    mods = {type(job.sink).__module__, "onceflow.sinks.base", "onceflow.sources.sequence"}
    try:
        mods.add(type(job.sink.data_source({})).__module__)
    except Exception:  # noqa: BLE001 - options may need a checkpoint; the sink module is enough
        pass
    return sorted(mods)


def _count(key, frames, state):
    """The warm-up query's stateful step: a running count per key (Spark's state store)."""
    import pandas as pd

    seen = state.get[0] if state.exists else 0
    batch = pd.concat(list(frames))
    state.update((seen + len(batch),))
    yield batch[["id"]]


#: the first warm-up runs this many micro-batches of :data:`WARM_ROWS` ids. The JVM compiles
#: (JIT) a method only after it ran many times, and much of a micro-batch runs once per batch
#: (analysis, planning, code generation, task scheduling, the offset, state and sink commits).
#: Measured on the demo job (2 cores; its active driver SIGKILLed just after a commit, then
#: its standby promoted; 3 takeovers each): kill -> first commit median 2.26 s after 1 warm-up
#: batch, 2.03 s after 3, 1.73 s after 5; the warm-up took 12-13.6 s, 14.3-14.7 s and 16.4-18.7 s.
WARM_BATCHES = 5
WARM_ROWS = 10_000


def warm_query(spark, tmp: str, batches: int = 1):
    """Start a small streaming query that touches what a job's first batch needs: onceflow's
    sequence source, a shuffle with ``applyInPandasWithState`` (the session's state store) and
    onceflow's Delta sink (Spark's Python daemons for planning, writers, the streaming sink
    runner; they outlive the query and fork the next query's processes warm). It runs
    ``batches`` micro-batches of :data:`WARM_ROWS` ids back to back, then idles: the caller
    stops it (:func:`_until_done`). ``tmp`` must exist."""
    from pyspark.sql.streaming.state import GroupStateTimeout

    df = (spark.readStream.format("onceflow-sequence").option("partitions", 2)
          .option("total", batches * WARM_ROWS)
          .option("release_file", tmp).option("max_rows_per_batch", WARM_ROWS // 10)  # all ids at once, WARM_ROWS a batch
          .load()
          .groupBy("key").applyInPandasWithState(_count, "id long", "n long", "append", GroupStateTimeout.NoTimeout))
    return (df.writeStream.format("onceflow-delta").option("path", f"{tmp}/table")
            .option("test_crash_at", "none")  # fault injection (tests) is for the real job
            .option("checkpointLocation", f"{tmp}/ckpt").trigger(processingTime="0 seconds").start())


def _until_done(q, batches: int, go: str | None, timeout_s: float = 120.0) -> bool:
    """Wait until ``q`` (:func:`warm_query`) ran ``batches`` batches with rows, then stop it; False
    when ``go`` appeared first (the query is stopped at once: the job is more urgent)."""
    deadline = time.monotonic() + timeout_s
    try:
        while not q.awaitTermination(0.1) and time.monotonic() < deadline:
            if go and os.path.exists(go):
                return False
            if sum(1 for p in q.recentProgress if p["numInputRows"]) >= batches:
                return True
        return not (go and os.path.exists(go))
    finally:
        q.stop()


def warm_up(spark, job: JobSpec, go: str | None = None, scratch: str | None = None, plan: bool = True,
            batches: int = WARM_BATCHES) -> float:
    """Start what the first batch of a takeover would otherwise wait for; returns seconds.

    ``batches`` streaming micro-batches (:func:`warm_query`), then one task per core that imports the job's sink
    and source modules in the reused Python workers. Once ``go`` exists (promoted while still
    warming up), the rest is skipped: the job itself is more urgent. Its throwaway table and
    checkpoint go to a directory under ``scratch`` (reclaimed with it should this die)."""
    started = time.monotonic()
    modules = _modules(job)
    if scratch:
        os.makedirs(scratch, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="onceflow-standby-", dir=scratch)
    try:
        if not _until_done(warm_query(spark, tmp, batches), batches, go):
            return time.monotonic() - started

        import_in_workers(spark, modules)
    except Exception as e:  # noqa: BLE001 - a failed warm-up only costs time at takeover
        log.warning("standby warm-up incomplete (%s); the takeover will start colder", e)
    else:
        if plan and not (go and os.path.exists(go)):
            plan_job(spark, job)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return time.monotonic() - started


def import_in_workers(spark, modules: list[str]) -> None:
    """One task per core that imports ``modules`` in Spark's (reused) Python workers."""

    def imports(batches):
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a module only the driver can import
                pass
        yield from batches

    parallelism = 2 if is_connect(spark) else max(1, spark.sparkContext.defaultParallelism)
    spark.range(0, parallelism, numPartitions=parallelism).mapInArrow(imports, "id long").collect()


#: Spark stops the idle Python workers of a pool that saw no activity for a minute (its
#: ``PythonWorkerFactory``; the daemons stay), and each kind of work has its own pool (tasks,
#: data-source lookup, planning, writing, the streaming sink's commits): a standby that waited
#: longer took over with fresh workers, each importing pandas, pyarrow and the sink anew (the
#: demo's takeover: 4.3-5.0 s instead of 2.4-2.9 s). While it waits, the standby runs its
#: warm-up query again this often (about 1.3 s and 2 s of CPU on 2 cores: 4% of one core).
KEEP_WARM_S = 45.0


def keep_warm(spark, job: JobSpec, go: str | None = None, scratch: str | None = None) -> None:
    """What a waiting standby runs every :data:`KEEP_WARM_S`, so that every Python worker
    pool's idle clock restarts: :func:`warm_up` without the job's DataFrame (no code of the job
    runs: its source may be down; it is built at the takeover). A failure costs only warmth
    (:func:`warm_up` logs it as a warning)."""
    try:
        warm_up(spark, job, go, scratch, plan=False, batches=1)  # the JIT keeps what it compiled
    except Exception as e:  # noqa: BLE001
        log.debug("standby: keeping the Python workers warm failed (%s)", e)


def plan_job(spark, job: JobSpec) -> None:
    """Build the job's DataFrame once and analyse it, then drop it: the promoted driver builds
    it again (with its own context) on a warm analyser and Py4J path (0.4 s at a takeover of the
    demo, 0.1-0.15 s in a session that had built it before). No query starts; a source that
    cannot be built now (a broker down) is built at the takeover, as before."""
    from onceflow.savepoint.context import RestoreContext

    try:
        job.dataframe(spark, RestoreContext("resumed")).schema  # noqa: B018 - analysis is the point
    except Exception as e:  # noqa: BLE001 - only warmth is lost
        log.info("standby: the job's DataFrame was not built ahead (%s); it is built at the takeover", e)


def wait_for_go(go: str, stop: threading.Event, poll_s: float = 0.02,
                warm: Callable[[], None] | None = None, warm_every_s: float = KEEP_WARM_S) -> bool:
    """Block until ``go`` exists (True), or a stop / the parent's death (False); ``warm``
    (:func:`keep_warm`) runs every ``warm_every_s`` meanwhile (about 1.3 s each time; a go file
    that appears meanwhile cuts its query short)."""
    parent = os.getppid()
    next_warm = time.monotonic() + warm_every_s
    while not stop.is_set():
        if os.path.exists(go):
            return True
        if os.getppid() != parent:  # the supervisor is gone: nobody will promote this standby
            log.info("standby: the supervisor (pid %d) is gone; exiting", parent)
            return False
        if warm is not None and time.monotonic() >= next_warm:
            warm()
            next_warm = time.monotonic() + warm_every_s
        stop.wait(poll_s)
    return False


def promote(go: str, holder: int | None) -> None:
    """Create the go file (atomically: the standby never reads half of it). ``holder``: the
    lease epoch of the dead driver the standby may take over (None: take nothing over)."""
    tmp = f"{go}.tmp"
    with open(tmp, "w") as f:
        f.write(f"at={time.time():.3f} takeover={int(holder is not None)} holder={holder or 0}\n")
    os.replace(tmp, go)


def takes_over(go: str) -> bool | int:
    """How the go file tells the promoted standby to take the lease (see module doc): the
    epoch it may take over, False for none, True (an empty or older go file) for any."""
    try:
        with open(go) as f:
            fields = dict(w.split("=", 1) for w in f.read().split() if "=" in w)
    except OSError:
        return True
    if fields.get("takeover") == "0":
        return False
    holder = int(fields.get("holder") or 0)
    return holder if holder > 0 else True


def mark_ready(go: str, warm_s: float) -> None:
    tmp = f"{go}.ready.tmp"
    with open(tmp, "w") as f:
        f.write(f"pid={os.getpid()} warm_s={warm_s:.3f}\n")
    os.replace(tmp, f"{go}.ready")
