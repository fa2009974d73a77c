"""Restoring a savepoint into a job's (empty) checkpoint directory: resume, fork, roll back, rescale.

* **resume**: the restored ``metadata`` keeps the savepoint's query id, so the sinks see the
  same lineage and continue after the savepoint's batch.
* **fork** (``fork=True``): a new query id is written into ``metadata`` — a new lineage the
  sinks treat as a new writer; the original job may keep running on its own checkpoint.
* **roll back**: restoring a savepoint older than what the sinks already committed for its
  lineage. Resuming that under the same lineage would re-run committed batch ids from other
  offsets; it is refused unless ``fork=True`` (the sinks' fingerprint check is the safety
  net behind this check). With ``fork=True`` the batches after the savepoint are replayed
  under the new lineage, and that is logged loudly.
* **partly visible next batch**: a sink whose tasks make rows visible on their own (Kafka,
  PostgreSQL ``idempotent``) may hold some partitions of the savepoint's next batch N under
  the savepoint's lineage without a decision (the job died or stopped with ReplayMismatch
  mid-batch). A fork replays all of batch N under the new lineage, so those partitions would
  be written twice: the fork is a roll back, and its WARNING names the sink, lineage, batch,
  partitions and row count that stay visible. Resuming the same lineage is the way that
  cannot duplicate them (its replay skips partitions that read the same rows).
* **rescale** (``rescale=N``): after restoring, Spark's offline state repartition
  (``StreamingCheckpointManager.repartition``, Spark 4.2+) rewrites the state into N
  partitions as an extra batch that reads no input. Spark 4.3 supports it for the RocksDB
  state store only; onceflow refuses it up front for HDFS-backed state and stateless jobs.

Everything that can be checked is checked before anything is written; a failure afterwards
(checksum mismatch found while copying, repartition error) removes what the restore wrote.
The restore is idempotent per savepoint: ``_onceflow/restore.json`` records it, so a driver
restarted by the supervisor does not restore twice.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from onceflow.checkpoint.eventlog import EVENTS_DIR, EventLog
from onceflow.checkpoint.layout import SINK_CACHE, CheckpointDir
from onceflow.savepoint.context import MARKER, RestoreContext, read_marker
from onceflow.savepoint.manifest import DATA_DIR, Manifest, SavepointError, read_manifest
from onceflow.savepoint.transfer import Copied, copy_tree
from onceflow.storage import url_to_fs

if TYPE_CHECKING:
    from onceflow.sinks.base import Sink


class Job(Protocol):
    """What a restore checks of the job it restores for (``onceflow.Job`` is one): the
    operators of its plan and its sink's decisions."""

    sink: Sink

    def dataframe(self, spark: Any, context: RestoreContext | None = None) -> Any: ...

log = logging.getLogger("onceflow.savepoint")

# ``onceflow run --from-savepoint/--fork/--rescale/--allow-non-restored-state`` -> the driver.
RESTORE_ENV = {
    "from_savepoint": "ONCEFLOW_FROM_SAVEPOINT",
    "fork": "ONCEFLOW_FORK",
    "rescale": "ONCEFLOW_RESCALE",
    "allow_non_restored_state": "ONCEFLOW_ALLOW_NON_RESTORED_STATE",
}


def restore_env(from_savepoint: str | None, fork: bool, rescale: int | None,
                allow_non_restored_state: bool) -> dict[str, str]:
    """Environment for the driver carrying the restore options of ``onceflow run``."""
    if not from_savepoint:
        return {}
    return {RESTORE_ENV["from_savepoint"]: from_savepoint, RESTORE_ENV["fork"]: "1" if fork else "",
            RESTORE_ENV["rescale"]: "" if rescale is None else str(rescale),
            RESTORE_ENV["allow_non_restored_state"]: "1" if allow_non_restored_state else ""}


def restore_options_from_env(environ) -> dict:
    """``job.run`` keyword arguments from :func:`restore_env`'s variables (driver side)."""
    sp = environ.get(RESTORE_ENV["from_savepoint"])
    if not sp:
        return {}
    rescale = environ.get(RESTORE_ENV["rescale"])
    return {"from_savepoint": sp, "fork": environ.get(RESTORE_ENV["fork"]) == "1",
            "rescale": int(rescale) if rescale else None,
            "allow_non_restored_state": environ.get(RESTORE_ENV["allow_non_restored_state"]) == "1"}


ROCKSDB = "RocksDBStateStoreProvider"

# Physical-plan node names (explain) -> operatorName in Spark's state metadata, normalised.
_ALIASES = {
    "statestorerestore": "statestoresave",
    "streamingdeduplicate": "dedupe",
    "streamingdeduplicatewithinwatermark": "dedupewithinwatermark",
    "flatmapgroupsinpandaswithstate": "applyinpandaswithstate",
    "streamingsymmetrichashjoin": "symmetrichashjoin",
    "streaminggloballimit": "globallimit",
    "transformwithstateinpyspark": "transformwithstateinpyspark",
}


def _norm(name: str | None) -> str | None:
    if not name:
        return None
    n = re.sub(r"[^a-z]", "", name.lower()).removesuffix("exec")
    return _ALIASES.get(n, n)


def job_operators(spark, job: Job, context: RestoreContext | None = None) -> dict[int, str]:
    """Stateful operators of ``job``'s query (id -> plan node name), from Spark's planner
    (the job's source and transform are called with ``context``: a plan is built, not run)."""
    from onceflow.spark import is_connect, register_all

    register_all(spark)
    df = job.dataframe(spark, context or RestoreContext("restored"))
    if is_connect(spark):
        plan = df._explain_string(mode="simple")
    else:
        plan = spark._jvm.PythonSQLUtils.explainString(df._jdf.queryExecution(), "simple")
    ops: dict[int, str] = {}
    for line in plan.splitlines():
        m = re.search(r"opId = (\d+)", line)
        if not m or "state info" not in line:
            continue
        name = re.match(r"^[\s:+\-|!*()\d]*([A-Za-z]+)", line)
        ops.setdefault(int(m.group(1)), name.group(1) if name else "?")
    return ops


@dataclass(frozen=True)
class PartlyVisible:
    """Partitions of batch ``batch`` of ``lineage`` visible in ``sink`` without a decision."""

    sink: str
    lineage: str
    batch: int
    partitions: dict[int, int | None]

    @property
    def rows(self) -> str:
        counts = [r for r in self.partitions.values() if r is not None]
        return f"{sum(counts)}" + (" or more" if len(counts) < len(self.partitions) else "")

    def describe(self) -> str:
        names = ", ".join(str(p) for p in sorted(self.partitions))
        return (f"{self.sink} holds partition(s) {names} of batch {self.batch} of lineage "
                f"{self.lineage} ({self.rows} rows) visible, although the batch was never decided")

    def event(self) -> dict[str, Any]:
        return {"sink": self.sink, "lineage": self.lineage, "batch": self.batch,
                "partitions": sorted(self.partitions), "rows": self.rows}


@dataclass
class RestoreResult:
    mode: str  # resume | fork | rollback | already_restored
    savepoint: str
    checkpoint: str
    batch: int
    lineage: str  # the lineage the job runs under after the restore
    savepoint_lineage: str
    rescaled_to: int | None = None
    skipped_operators: tuple[int, ...] = ()
    #: the savepoint's next batch, partly visible in the sink under the savepoint's lineage
    partly_visible: PartlyVisible | None = None


@dataclass
class RestoreRequest:
    """``job.run(from_savepoint=...)`` / ``onceflow run --from-savepoint``: what to restore and how."""

    savepoint: str
    fork: bool = False
    rescale: int | None = None
    allow_non_restored_state: bool = False

    def check(self, checkpoint_url: str, *, job: Job | None = None, spark=None) -> Manifest:
        """Every refusal a restore can make before copying, without writing anything: the
        manifest, the files' presence and sizes, an empty target, ``--rescale``, and with
        ``job`` and ``spark`` the operators and roll back (``job.run`` calls this before it
        creates the checkpoint directory). Checksums are verified while copying."""
        return self._checks(checkpoint_url, job, spark)[0]

    def _checks(self, checkpoint_url: str, job: Job | None, spark):
        """(manifest, mode, who committed after, skipped operators, previous marker, partly
        visible next batch)."""
        sp_url = self.savepoint.rstrip("/")
        manifest = read_manifest(sp_url)
        sp_id = f"{manifest.lineage}:{manifest.batch}:{manifest.created}"
        target = CheckpointDir(checkpoint_url)
        fs, root = target.fs, target.path.rstrip("/")
        previous = read_marker(fs, f"{root}/{MARKER}")
        if previous and previous.get("id") == sp_id and previous.get("status") == "done":
            return manifest, "already_restored", None, [], previous, None
        if not (previous and previous.get("id") == sp_id and previous.get("status") == "in_progress"):
            _require_empty(fs, root, target.url)
        if self.rescale is not None and self.rescale < 1:
            raise SavepointError(f"--rescale {self.rescale}: give a number of state partitions >= 1")
        sp_fs, sp_root = url_to_fs(sp_url)
        _check_present(sp_fs, sp_root, sp_url, manifest)
        context = RestoreContext("restored", savepoint=sp_url, restore_mode="fork" if self.fork else "resume",
                                 rescaled_to=self.rescale)
        ops = job_operators(spark, job, context) if job is not None and spark is not None else None
        self._check_rescale(manifest, ops, spark, job is not None)
        skipped = self._check_operators(manifest, ops)
        mode = "fork" if self.fork else "resume"
        committed_after = self._committed_after(manifest, job, target.url)
        if committed_after:
            if not self.fork:
                raise SavepointError(
                    f"savepoint {sp_url} is at batch {manifest.batch} of lineage {manifest.lineage}, "
                    f"but {committed_after} already committed later batches of that lineage: this is "
                    "a roll back. Resuming it under the same lineage would re-run batch ids the sinks "
                    "already committed from different offsets. Restore with --fork (fork=True): a new "
                    "lineage replays from the savepoint's offsets and the sinks receive the rows "
                    "after the savepoint again, under the new lineage."
                )
            mode = "rollback"
        partly = None if committed_after else self._partly_visible(manifest, job, target.url)
        if partly is not None and self.fork:
            mode = "rollback"  # the fork writes batch N's visible partitions a second time
        return manifest, mode, committed_after, skipped, previous, partly

    def apply(self, checkpoint_url: str, *, job: Job | None = None, spark=None) -> RestoreResult:
        """Restore into ``checkpoint_url``. With ``job`` and ``spark`` the operators, the sinks'
        decisions (roll back) and rescale are checked; without, only the files are restored."""
        sp_url = self.savepoint.rstrip("/")
        target = CheckpointDir(checkpoint_url)
        fs, root = target.fs, target.path.rstrip("/")
        manifest, mode, committed_after, skipped, previous, partly = self._checks(checkpoint_url, job, spark)
        sp_id = f"{manifest.lineage}:{manifest.batch}:{manifest.created}"
        if mode == "already_restored":
            log.info("checkpoint %s was already restored from %s; continuing", target.url, sp_url)
            return RestoreResult("already_restored", sp_url, target.url, manifest.batch,
                                 previous.get("lineage", manifest.lineage), manifest.lineage,
                                 previous.get("rescaled_to"))
        if previous and previous.get("id") == sp_id and previous.get("status") == "in_progress":
            _wipe(fs, root)  # an interrupted restore of this same savepoint: start over
        sp_fs, sp_root = url_to_fs(sp_url)

        lineage = str(uuid.uuid4()) if self.fork else manifest.lineage
        existed = fs.exists(root)
        _write_marker(fs, f"{root}/{MARKER}", {"id": sp_id, "status": "in_progress", "savepoint": sp_url})
        try:
            if fs.exists(f"{root}/{SINK_CACHE}"):  # the target's history before the restore
                fs.rm(f"{root}/{SINK_CACHE}", recursive=True)
            self._copy(manifest, sp_fs, sp_root, sp_url, fs, root, skipped)
            if self.fork:
                with fs.open(f"{root}/metadata", "w") as f:
                    f.write(json.dumps({"id": lineage}, separators=(",", ":")))
            if self.rescale:
                _repartition(spark, target.url, self.rescale)
        except BaseException:
            _wipe(fs, root)
            if not existed and fs.exists(root):
                fs.rm(root, recursive=True)
            raise
        _write_marker(fs, f"{root}/{MARKER}", {
            "id": sp_id, "status": "done", "savepoint": sp_url, "lineage": lineage,
            "mode": mode, "rescaled_to": self.rescale, "ts": round(time.time(), 3),
        })
        result = RestoreResult(mode, sp_url, target.url, manifest.batch, lineage, manifest.lineage,
                               self.rescale, tuple(skipped), partly)
        if mode == "rollback" and committed_after:
            log.warning(
                "ROLL BACK: restored %s (batch %d of lineage %s) although %s committed later "
                "batches. Their rows STAY VISIBLE: the job continues under the NEW lineage %s and "
                "replays everything after batch %d, so the sink receives those rows again",
                sp_url, manifest.batch, manifest.lineage, committed_after, lineage, manifest.batch)
        elif mode == "rollback" and partly is not None:
            log.warning(
                "ROLL BACK: forked %s (batch %d of lineage %s) although %s. Those rows STAY "
                "VISIBLE: the job continues under the NEW lineage %s and replays all of batch %d, "
                "so up to %s rows are DUPLICATED in the sink. To avoid that, resume lineage %s "
                "instead (its replay skips those partitions) or fork from a savepoint taken at or "
                "after batch %d", sp_url, manifest.batch, manifest.lineage, partly.describe(), lineage,
                partly.batch, partly.rows, manifest.lineage, partly.batch)
        elif partly is not None:
            log.warning(
                "restored %s (batch %d) into %s, resuming lineage %s although %s: the replay of "
                "batch %d skips each of them whose input is the same (same offsets/%d, "
                "deterministic transform); if it differs, the job stops with ReplayMismatch and "
                "writes nothing", sp_url, manifest.batch, target.url, lineage, partly.describe(),
                partly.batch, partly.batch)
        else:
            log.info("restored %s (batch %d) into %s: %s, lineage %s", sp_url, manifest.batch,
                     target.url, mode, lineage)
        EventLog(target.url).append(
            "restore", savepoint=sp_url, mode=mode, batch=manifest.batch, lineage=lineage,
            savepoint_lineage=manifest.lineage, rescaled_to=self.rescale,
            skipped_operators=list(skipped), committed_after=committed_after,
            partly_visible=partly.event() if partly is not None else None,
        )
        return result

    # ---- checks (nothing written yet) -------------------------------------------------

    def _check_operators(self, manifest: Manifest, ops: dict[int, str] | None) -> list[int]:
        """Operator ids in the savepoint that the job does not have (dropped with the flag)."""
        if ops is None:
            return []
        saved = {o.id: o for o in manifest.operators}
        for op, name in sorted(ops.items()):
            if op not in saved:
                raise SavepointError(
                    f"the job's stateful operator {op} ({name}) has no state in savepoint "
                    f"{self.savepoint} (taken from job {manifest.job!r} with "
                    f"{len(saved)} stateful operator(s)): the savepoint belongs to a different "
                    "job, or a stateful operator was added, which Spark cannot start from a "
                    "mid-stream checkpoint"
                )
            want, have = _norm(name), _norm(saved[op].name)
            if want and have and want != have:
                raise SavepointError(
                    f"stateful operator {op} is {name} in the job but {saved[op].name} in savepoint "
                    f"{self.savepoint} (job {manifest.job!r}): the operators do not match; the "
                    "savepoint belongs to a different job or the pipeline changed"
                )
        extra = sorted(set(saved) - set(ops))
        if extra and not self.allow_non_restored_state:
            names = ", ".join(f"{i} ({saved[i].name})" for i in extra)
            raise SavepointError(
                f"savepoint {self.savepoint} holds state for operator(s) {names} that the job does "
                "not have (different job, or the operator was removed); pass "
                "--allow-non-restored-state to drop that state"
            )
        return extra

    def _check_rescale(self, manifest: Manifest, ops: dict[int, str] | None, spark, job_given: bool) -> None:
        if self.rescale is None:
            return
        stateful = manifest.stateful and (ops is None or bool(ops))
        if not stateful:
            raise SavepointError(
                f"--rescale {self.rescale}: the job is stateless (savepoint {self.savepoint} holds no "
                "operator state), so there is no state to repartition; just change "
                "spark.sql.shuffle.partitions"
            )
        provider = manifest.state_provider or ""
        if ROCKSDB not in provider:
            raise SavepointError(
                f"--rescale needs the RocksDB state store: Spark {_spark_version()}'s offline "
                f"state repartition refuses {provider.rsplit('.', 1)[-1] or 'this provider'} "
                "(STATE_REPARTITION_INVALID_CHECKPOINT.UNSUPPORTED_PROVIDER). Run the job with "
                "CheckpointConfig(state_backend='rocksdb') to make its state rescalable"
            )
        current = max((o.partitions for o in manifest.operators), default=None)
        if current == self.rescale:
            raise SavepointError(f"--rescale {self.rescale}: the state already has {current} partitions")
        if spark is None and not job_given:  # check() before job.run made its session: later
            raise SavepointError("--rescale needs a SparkSession (restore through job.run or onceflow run)")

    def _last_replayed(self, manifest: Manifest) -> int:
        """The last batch id the restored job re-runs from saved offsets: the planned batch
        when the savepoint holds one (not with rescale, whose extra batch takes its id)."""
        if manifest.planned_batch is not None and not self.rescale:
            return manifest.planned_batch
        return manifest.batch

    @staticmethod
    def _sink(job: Job, checkpoint_url: str) -> Any:
        """The job's sink data source for reads beside a possibly running job of the lineage."""
        sink = job.sink.data_source({"checkpointlocation": checkpoint_url})
        # Forking a running job: its lineage is live, a read must not fence its transactions.
        sink.fence_stale = False
        return sink

    def _partly_visible(self, manifest: Manifest, job: Job | None, checkpoint_url: str) -> PartlyVisible | None:
        """The savepoint's next batch when the job's sink shows some of its partitions under
        the savepoint's lineage without a decision (asked only when that batch is undecided)."""
        if job is None:
            return None
        nxt = self._last_replayed(manifest) + 1
        sink = self._sink(job, checkpoint_url)
        parts = sink.visible_partitions(manifest.lineage, nxt)
        if not parts:
            return None
        return PartlyVisible(f"sink {job.sink.format_name} ({sink!r})", manifest.lineage, nxt, dict(parts))

    def _committed_after(self, manifest: Manifest, job: Job | None, checkpoint_url: str) -> str | None:
        """Who already committed batches after the savepoint's batch for its lineage, if anyone.

        A decision for the savepoint's planned batch is not a roll back: the restored job
        replays that batch from the same ``offsets/N+1`` the sink's fingerprint was taken of."""
        last = self._last_replayed(manifest)
        nxt = last + 1
        if job is not None:
            sink = self._sink(job, checkpoint_url)
            if sink.decision(manifest.lineage, nxt) is not None:
                return f"the sink {job.sink.format_name} (it holds a decision for batch {nxt})"
        origin = CheckpointDir(manifest.created_from)
        try:
            if origin.exists() and origin.lineage == manifest.lineage:
                done = origin.last_committed()
                if done is not None and done > last:
                    return f"the original checkpoint {origin.url} (last committed batch {done})"
        except (OSError, ValueError):
            return None
        return None

    # ---- writing ------------------------------------------------------------------------

    def _copy(self, manifest, sp_fs, sp_root, sp_url, fs, root, skipped) -> None:
        expected = {f.path: f for f in manifest.files}
        drop = tuple(f"{DATA_DIR}/state/{op}/" for op in skipped)
        if manifest.planned_batch is not None and self._last_replayed(manifest) != manifest.planned_batch:
            drop += (f"{DATA_DIR}/offsets/{manifest.planned_batch}",)  # rescale takes its id
        prefix = f"{DATA_DIR}/"
        items = [
            (f.path, f"{sp_root}/{f.path}", f"{root}/{f.path[len(prefix):]}")
            for f in manifest.files if not f.path.startswith(drop)
        ]

        def check(c: Copied) -> None:
            want = expected[c.rel]
            if c.size != want.size or c.sha256 != want.sha256:
                what = (f"size {c.size} instead of {want.size}" if c.size != want.size
                        else "its SHA-256 does not match the manifest")
                raise SavepointError(
                    f"savepoint {sp_url} is damaged: {c.rel} has {what}; nothing was restored "
                    "(use an intact copy of the savepoint)"
                )

        copy_tree(items, sp_fs, fs, check)


def remove_if_only_onceflow(checkpoint_url: str) -> bool:
    """After a refused restore into a directory that was absent: remove it again if it holds
    nothing but onceflow's ``_onceflow/`` (lease, restore marker). True if removed."""
    target = CheckpointDir(checkpoint_url)
    fs, root = target.fs, target.path.rstrip("/")
    names = _entries(fs, root)
    if not fs.exists(root) or not set(names) <= {EVENTS_DIR}:
        return False
    fs.rm(root, recursive=True)
    return True


def _repartition(spark, url: str, partitions: int) -> None:
    from onceflow.spark import is_connect

    if spark is not None and is_connect(spark):
        raise SavepointError("--rescale needs a classic Spark session: Spark 4.3 does not offer its "
                             "offline state repartition over Spark Connect. Restore with --rescale "
                             "once without --remote (a local master is enough), then run over Connect")
    try:
        spark._streamingCheckpointManager.repartition(url, partitions)
    except Exception as e:  # noqa: BLE001 - Py4J carries Spark's error class in the text
        first = next((ln for ln in str(e).splitlines() if "Error" in ln or "Exception" in ln), str(e))
        raise SavepointError(f"Spark's state repartition to {partitions} partitions failed: {first.strip()[:400]}") from None


def _spark_version() -> str:
    from onceflow.savepoint.create import spark_version

    return spark_version()


def _write_marker(fs, path: str, record: dict) -> None:
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "w") as f:
        json.dump(record, f)


def _entries(fs, root: str) -> list[str]:
    try:
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
    except FileNotFoundError:
        return []


def _require_empty(fs, root: str, url: str) -> None:
    """Only onceflow's own ``_onceflow/`` (lease, event log) may already be there."""
    names = [n for n in _entries(fs, root) if n != EVENTS_DIR]
    if names:
        shown = ", ".join(sorted(names)[:5])
        raise SavepointError(
            f"cannot restore into {url}: it is not empty ({shown}); a savepoint is restored into "
            "an empty or absent checkpoint directory — give the job another checkpoint directory "
            "(onceflow run --checkpoint URL) or delete this one if it is no longer needed"
        )


def _check_present(sp_fs, sp_root: str, sp_url: str, manifest: Manifest) -> None:
    """Every listed file exists with its recorded size (cheap; hashes are checked while copying)."""
    try:
        listing = {
            p.rstrip("/"): info for p, info in sp_fs.find(sp_root, detail=True).items()
        }
    except FileNotFoundError:
        listing = {}
    for f in manifest.files:
        info = listing.get(f"{sp_root}/{f.path}")
        if info is None:
            raise SavepointError(
                f"savepoint {sp_url} is incomplete: {f.path} is missing; nothing was restored "
                "(use an intact copy of the savepoint)"
            )
        if int(info.get("size") or 0) != f.size:
            raise SavepointError(
                f"savepoint {sp_url} is damaged: {f.path} has {info.get('size')} bytes, the manifest "
                f"says {f.size}; nothing was restored (use an intact copy of the savepoint)"
            )


def _wipe(fs, root: str) -> None:
    """Remove what a restore wrote: everything but the event log and the lease."""
    for name in _entries(fs, root):
        path = f"{root}/{name}"
        if name == EVENTS_DIR:
            if fs.exists(f"{root}/{MARKER}"):
                fs.rm(f"{root}/{MARKER}")
            continue
        fs.rm(path, recursive=True)
