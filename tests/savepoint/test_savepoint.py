"""Savepoints on real Spark: resume, fork, roll back, rescale, relocation, bad inputs.

The job is the demo's stateful running count (applyInPandasWithState): each event id is
written with its key's running count, so the sink's exact expected contents are known:
id i (key i % 16) has running_count i // 16 + 1 — whatever stops, savepoints and restores
happened in between. One checkpoint history per state backend is built once per module and
shared; resume and roll back run on both backends, the rest on the HDFS-backed one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time

import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from onceflow.checkpoint.eventlog import EventLog
from onceflow.checkpoint.layout import CheckpointDir
from onceflow.demo.job import transform as running_count
from onceflow.errors import ConfigError, OnceflowError
from onceflow.job import CheckpointConfig, Job
from onceflow.runtime.restart import fixed_delay
from onceflow.savepoint import (
    RestoreRequest,
    SavepointError,
    create_savepoint,
    dispose_savepoint,
    inspect_savepoint,
    list_savepoints,
    read_manifest,
)
from onceflow.sinks.delta import DeltaSink
from onceflow.sinks.delta.files import parse_unit, unit

KEYS = 16


def seq(total: int, per_batch: int = 1000, rate: int = 10_000_000):
    def source(spark):
        return (
            spark.readStream.format("onceflow-sequence")
            .option("total", total).option("rows_per_second", rate)
            .option("max_rows_per_batch", per_batch).option("keys", KEYS).load()
        )

    return source


def counting_job(ckpt, table, total, backend="hashmap", transform=running_count, name="counts",
                 conf=None, rate=10_000_000) -> Job:
    return Job(
        name=name, source=seq(total, rate=rate), transform=transform, sink=DeltaSink(str(table)),
        checkpoint=CheckpointConfig(str(ckpt), interval=0, state_backend=backend),
        restart_strategy=fixed_delay(attempts=1, delay=0), stop_when_idle=0.5, spark_conf=conf or {},
    )


def rows_by_lineage(table) -> dict[str, list[tuple[int, int]]]:
    """Committed (id, running_count) rows per writer lineage (from the names of the Delta files' units)."""
    dt = DeltaTable(str(table))
    out: dict[str, list[tuple[int, int]]] = {}
    for uri in dt.file_uris():
        lineage = parse_unit(unit(os.path.relpath(uri.removeprefix("file://"), table)))[0]
        t = pq.read_table(uri.removeprefix("file://"), columns=["id", "running_count"])
        out.setdefault(lineage, []).extend(zip(t["id"].to_pylist(), t["running_count"].to_pylist(), strict=True))
    return {k: sorted(v) for k, v in out.items()}


def expected(lo: int, hi: int) -> list[tuple[int, int]]:
    """What an uninterrupted run writes for ids lo..hi-1."""
    return [(i, i // KEYS + 1) for i in range(lo, hi)]


def tree(path) -> list[str]:
    if not os.path.exists(path):
        return []
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


_HISTORIES: dict[str, dict] = {}


def _history(spark, tmp_path_factory, backend: str) -> dict:
    """ckpt ran to 2000 ids -> sp1; then on to 4000 ids -> sp2 (1000 ids per batch)."""
    if backend not in _HISTORIES:
        base = tmp_path_factory.mktemp(f"history-{backend}")
        ckpt, table = base / "ckpt", base / "table"
        counting_job(ckpt, table, 2000, backend).run(spark=spark)
        sp1, m1 = create_savepoint(str(ckpt), str(base / "sp1"))
        counting_job(ckpt, table, 4000, backend).run(spark=spark)
        sp2, m2 = create_savepoint(str(ckpt))  # default target: ../savepoints/sp-<batch>-<time>
        _HISTORIES[backend] = {"base": base, "ckpt": ckpt, "table": table, "sp1": sp1, "sp2": sp2, "m1": m1,
                               "m2": m2, "lineage": CheckpointDir(str(ckpt)).lineage, "backend": backend}
    return _HISTORIES[backend]


@pytest.fixture(scope="module")
def history(spark, tmp_path_factory):
    return _history(spark, tmp_path_factory, "hashmap")


@pytest.fixture(scope="module", params=["hashmap", "rocksdb"])
def any_history(spark, tmp_path_factory, request):
    return _history(spark, tmp_path_factory, request.param)


def test_savepoint_format(history):
    m1, m2 = history["m1"], history["m2"]
    assert m2.batch == m1.batch + 2  # two batches of 1000 ids in between
    assert m2.source_offsets == [{"next": 4000}] and m1.source_offsets == [{"next": 2000}]
    assert m2.lineage == history["lineage"] and m2.job == "counts"
    assert [(o.id, o.name, o.partitions) for o in m2.operators] == [(0, "applyInPandasWithState", 4)]
    assert m2.state_provider.endswith("HDFSBackedStateStoreProvider")
    assert history["sp2"].startswith(str(history["base"] / "savepoints" / f"sp-{m2.batch}-"))
    paths = {f.path for f in m2.files}
    # only the last batch's offsets/commits, state up to version batch+1, relative paths only
    b = m2.batch
    assert {"checkpoint/metadata", f"checkpoint/offsets/{b}", f"checkpoint/commits/{b}"} <= paths
    logs = {p for p in paths if re.match(r"checkpoint/(offsets|commits)/", p)}
    assert logs == {f"checkpoint/{d}/{n}" for d in ("offsets", "commits") for n in (b - 1, b)}
    assert f"checkpoint/state/0/0/{b + 1}.delta" in paths  # state version batch + 1
    assert f"checkpoint/state/0/0/{b + 2}.delta" not in paths
    assert all(not p.startswith("/") and "_onceflow" not in p for p in paths)
    raw = json.loads(open(os.path.join(history["sp2"], "_savepoint.json")).read())
    assert raw["format_version"] == 1 and raw["spark_version"].startswith("4.3")
    assert inspect_savepoint(history["sp2"]).verified is True
    listed = [url for url, _ in list_savepoints(str(history["ckpt"]))]
    assert listed == [history["sp2"]]


def test_resume_from_relocated_savepoint_equals_uninterrupted_run(spark, any_history, tmp_path):
    history = any_history
    moved = tmp_path / "elsewhere" / "sp"
    shutil.copytree(history["sp2"], moved)  # a savepoint is relocatable
    table = tmp_path / "table"
    shutil.copytree(history["table"], table)  # the sink as the original job left it
    ckpt = tmp_path / "ckpt"
    counting_job(ckpt, table, 6000, history["backend"]).run(spark=spark, from_savepoint=str(moved))
    assert CheckpointDir(str(ckpt)).lineage == history["lineage"]  # resume keeps the lineage
    assert rows_by_lineage(table) == {history["lineage"]: expected(0, 6000)}
    b = history["m2"].batch
    assert CheckpointDir(str(ckpt)).committed_batches() == [b - 1, b, b + 1, b + 2]  # 2 new batches


def test_roll_back_needs_fork_then_replays_under_a_new_lineage(spark, any_history, tmp_path):
    history = any_history
    table = tmp_path / "table"
    shutil.copytree(history["table"], table)
    before = tree(table)
    ckpt = tmp_path / "ckpt"
    with pytest.raises(OnceflowError, match=r"roll back.*--fork"):
        counting_job(ckpt, table, 6000, history["backend"]).run(spark=spark, from_savepoint=history["sp1"])
    assert tree(table) == before
    assert not ckpt.exists()  # nothing changed on disk

    counting_job(ckpt, table, 6000, history["backend"]).run(spark=spark, from_savepoint=history["sp1"], fork=True)
    new = CheckpointDir(str(ckpt)).lineage
    assert new != history["lineage"]
    # The old lineage's rows stay; the fork replays from sp1's offsets (id 2000) on.
    assert rows_by_lineage(table) == {history["lineage"]: expected(0, 4000), new: expected(2000, 6000)}
    events = [json.loads(x) for x in open(ckpt / "_onceflow" / "events.jsonl")]
    assert any(e["event"] == "restore" and e["mode"] == "rollback" for e in events)


def test_restore_context_says_which_savepoint_and_how(spark, history, tmp_path):
    """The run that restores sees start="restored" with the savepoint and the fork; a
    later run of that checkpoint sees 'resumed', still naming the savepoint it came from."""
    table = tmp_path / "table"
    shutil.copytree(history["table"], table)
    seen = []

    def transform(df, ctx):
        seen.append(ctx)
        return running_count(df)

    counting_job(tmp_path / "ckpt", table, 5000, transform=transform).run(
        spark=spark, from_savepoint=history["sp2"], fork=True)
    counting_job(tmp_path / "ckpt", table, 6000, transform=transform).run(spark=spark)
    lineage = CheckpointDir(str(tmp_path / "ckpt")).lineage
    # Before restoring, onceflow builds the job's plan (not run) to check its operators.
    plans, seen = [c for c in seen if c.lineage is None], [c for c in seen if c.lineage is not None]
    assert plans and {(c.start, c.savepoint, c.restore_mode) for c in plans} == {
        ("restored", str(history["sp2"]).rstrip("/"), "fork")}
    assert [(c.start, c.is_restored, c.from_savepoint, c.forked) for c in seen] == [
        ("restored", True, True, True), ("resumed", True, True, True)]
    assert {(c.savepoint, c.restore_mode, c.rescaled_to, c.lineage) for c in seen} == {
        (str(history["sp2"]).rstrip("/"), "fork", None, lineage)}


def test_fork_runs_alongside_the_original_with_its_own_lineage(spark, history, tmp_path):
    """The original job resumes from sp2 while a fork of sp2 runs at the same time, both writing
    to the same Delta table: each keeps its own lineage, and neither disturbs the other."""
    table = tmp_path / "table"
    shutil.copytree(history["table"], table)
    original = tree(history["ckpt"])
    # 2000 more ids each at 250 ids/s: both queries commit for ~8 s, so their commits interleave.
    runs = {
        "original": (counting_job(tmp_path / "original", table, 6000, rate=250), {}),
        "fork": (counting_job(tmp_path / "fork", table, 6000, rate=250, name="counts-fork"), {"fork": True}),
    }
    errors: dict[str, BaseException] = {}

    def run(name: str) -> None:
        job, extra = runs[name]
        try:  # two queries of one Spark session (so two query names), as in one driver
            job.run(spark=spark, from_savepoint=history["sp2"], **extra)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[name] = e

    threads = [threading.Thread(target=run, args=(name,)) for name in runs]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while not any(q.name == "counts" for q in spark.streams.active) and time.monotonic() < deadline:
        time.sleep(0.1)
    # A third job named like a running one is refused up front, not restarted into a name clash.
    with pytest.raises(ConfigError, match="already running in this Spark session"):
        counting_job(tmp_path / "third", table, 6000).run(spark=spark)
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    lineage = {name: CheckpointDir(str(tmp_path / name)).lineage for name in runs}
    assert lineage["original"] == history["lineage"] and lineage["fork"] != history["lineage"]
    commits = {name: [e["ts"] for e in EventLog(str(tmp_path / name)).read() if e["event"] == "sink_commit"]
               for name in runs}
    assert min(commits["fork"]) < max(commits["original"]) and min(commits["original"]) < max(commits["fork"])
    assert tree(history["ckpt"]) == original  # the original's old checkpoint: not touched
    # Both writers' rows side by side: the original's whole run, the fork's from its savepoint on.
    assert rows_by_lineage(table) == {history["lineage"]: expected(0, 6000), lineage["fork"]: expected(4000, 6000)}
    restores = {name: [(e["mode"], e["savepoint_lineage"], e["lineage"])
                       for e in EventLog(str(tmp_path / name)).read() if e["event"] == "restore"] for name in runs}
    assert restores == {"original": [("resume", history["lineage"], history["lineage"])],
                        "fork": [("fork", history["lineage"], lineage["fork"])]}


def test_rescale_rocksdb_2_to_4_to_3_keeps_every_count(spark, tmp_path):
    shuffle = spark.conf.get("spark.sql.shuffle.partitions")
    try:
        ckpt, table = tmp_path / "ckpt", tmp_path / "table"
        counting_job(ckpt, table, 2000, backend="rocksdb", conf={"spark.sql.shuffle.partitions": "2"}).run(spark=spark)
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", shuffle)  # the session is shared
    sp, manifest = create_savepoint(str(ckpt), str(tmp_path / "sp"))
    assert "RocksDB" in manifest.state_provider and manifest.operators[0].partitions == 2
    assert any(f.path.endswith(".sst") or f.path.endswith(".changelog") for f in manifest.files)
    for n, (src, total) in enumerate([(sp, 4000), (None, 6000)]):
        parts = (4, 3)[n]
        if src is None:  # the 4-partition job, stopped, saved again
            src, m = create_savepoint(str(tmp_path / "ckpt4"), str(tmp_path / "sp4"))
            assert m.operators[0].partitions == 4 and m.lineage == manifest.lineage
        c = tmp_path / f"ckpt{parts}"
        counting_job(c, table, total, backend="rocksdb").run(spark=spark, from_savepoint=src, rescale=parts)
        cd = CheckpointDir(str(c))
        assert cd.offsets(cd.last_committed()).metadata["conf"]["spark.sql.shuffle.partitions"] == str(parts)
        assert cd.lineage == manifest.lineage
        assert rows_by_lineage(table) == {manifest.lineage: expected(0, total)}


def test_a_planned_batch_the_sink_already_decided_is_replayed_not_a_roll_back(spark, history, tmp_path):
    """A stop that interrupts batch N+1 after the sink decided it, before Spark's commits/N+1:
    the savepoint (last committed N) keeps offsets/N+1 and a plain resume replays N+1 from them."""
    ckpt, table = tmp_path / "ckpt", tmp_path / "table"
    shutil.copytree(history["ckpt"], ckpt)
    shutil.copytree(history["table"], table)
    last = history["m2"].batch
    os.remove(ckpt / "commits" / str(last))  # the sink holds batch `last`; Spark has no commit
    sp, m = create_savepoint(str(ckpt), str(tmp_path / "sp"))
    assert (m.batch, m.planned_batch) == (last - 1, last)
    assert f"checkpoint/offsets/{last}" in {f.path for f in m.files}
    c2 = tmp_path / "c2"
    counting_job(c2, table, 6000).run(spark=spark, from_savepoint=sp)  # not refused as a roll back
    assert rows_by_lineage(table) == {history["lineage"]: expected(0, 6000)}
    replays = [e for e in EventLog(str(c2)).read() if e["event"] == "sink_commit" and e.get("replay")]
    assert [e["batch"] for e in replays] == [last]


# ---- bad input: clear errors, nothing changed on disk --------------------------------------


def _damaged_copy(src, dst, how: str) -> str:
    shutil.copytree(src, dst)
    name = f"checkpoint/state/0/1/{read_manifest(str(src)).batch + 1}.delta"
    victim = os.path.join(dst, name)
    if how == "missing":
        os.remove(victim)
    elif how == "truncated":
        with open(victim, "r+b") as f:
            f.truncate(os.path.getsize(victim) // 2)
    else:  # same size, one byte changed
        data = bytearray(open(victim, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(victim, "wb").write(bytes(data))
    return name


@pytest.mark.parametrize("how,msg", [("missing", "is missing"), ("truncated", "bytes, the manifest says"),
                                     ("tampered", "SHA-256 does not match")])
def test_damaged_savepoint_is_refused_naming_the_file(spark, history, tmp_path, how, msg):
    name = _damaged_copy(history["sp2"], tmp_path / "sp", how)
    target = tmp_path / "ckpt"
    with pytest.raises(SavepointError, match=re.escape(name) + ".*" if how != "tampered" else re.escape(name)) as e:
        RestoreRequest(str(tmp_path / "sp")).apply(str(target))
    assert msg in str(e.value)
    assert not target.exists()
    if how == "tampered":  # found while copying, through job.run (lease, event log): still absent
        with pytest.raises(SavepointError, match=re.escape(name)):
            counting_job(target, tmp_path / "t", 10).run(spark=spark, from_savepoint=str(tmp_path / "sp"))
        assert not target.exists() and not (tmp_path / "t").exists()
    assert not inspect_savepoint(str(tmp_path / "sp")).ok


def test_restore_into_non_empty_checkpoint_is_refused(spark, history):
    before = tree(history["ckpt"])
    with pytest.raises(SavepointError, match="not empty"):
        RestoreRequest(history["sp2"]).apply(str(history["ckpt"]))
    with pytest.raises(SavepointError, match="not empty"):
        counting_job(history["ckpt"], history["table"], 10).run(spark=spark, from_savepoint=history["sp2"])
    assert tree(history["ckpt"]) == before


def test_savepoint_of_a_different_job_is_refused(spark, history, tmp_path):
    target = tmp_path / "ckpt"

    def other(df):  # a different stateful operator at id 0
        return df.groupBy("key").count().withColumnRenamed("count", "running_count") \
            .selectExpr("key AS id", "running_count")

    with pytest.raises(SavepointError, match="operator 0 is StateStoreSave.*applyInPandasWithState"):
        counting_job(target, tmp_path / "t", 10, transform=other).run(spark=spark, from_savepoint=history["sp2"])
    stateless = counting_job(target, tmp_path / "t", 10, transform=lambda df: df)
    with pytest.raises(SavepointError, match="--allow-non-restored-state"):
        RestoreRequest(history["sp2"]).apply(str(target), job=stateless, spark=spark)
    with pytest.raises(SavepointError, match="stateless"):
        stateless.run(spark=spark, from_savepoint=history["sp2"], rescale=3, allow_non_restored_state=True)
    with pytest.raises(SavepointError, match="RocksDB"):
        counting_job(target, tmp_path / "t", 10).run(spark=spark, from_savepoint=history["sp2"], rescale=3)
    with pytest.raises(SavepointError, match="--rescale 0: give a number"):
        counting_job(target, tmp_path / "t", 10).run(spark=spark, from_savepoint=history["sp2"], rescale=0)
    assert not target.exists() and not (tmp_path / "t").exists()  # nothing changed on disk
    # Flink's --allow-non-restored-state: the stateless job starts from the offsets, no state.
    result = RestoreRequest(history["sp2"], allow_non_restored_state=True).apply(
        str(target), job=stateless, spark=spark)
    assert result.skipped_operators == (0,) and not (target / "state").exists()
    assert (target / "offsets" / str(history["m2"].batch)).exists()


def test_create_refuses_a_running_job_and_dispose_keeps_non_savepoints(history, tmp_path):
    from onceflow.checkpoint.lease import DriverLease

    lease = DriverLease(str(history["ckpt"]), "counts").acquire()
    try:
        with pytest.raises(SavepointError, match="is running.*onceflow stop --savepoint"):
            create_savepoint(str(history["ckpt"]), str(tmp_path / "sp"))
    finally:
        lease.release()
    assert not (tmp_path / "sp").exists()
    with pytest.raises(SavepointError, match="not a savepoint"):
        dispose_savepoint(str(history["ckpt"]))
    copy = tmp_path / "copy"
    shutil.copytree(history["sp1"], copy)
    assert dispose_savepoint(str(copy)).batch == history["m1"].batch and not copy.exists()
    assert read_manifest(history["sp1"]).batch == history["m1"].batch
