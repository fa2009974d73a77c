"""Delta sink: partitioned tables and schema evolution, on both write paths (real Spark).

Every table is read back by readers that are not the sink's code: delta-rs
(``DeltaTable.to_pyarrow_table``), the raw JSON log, and a pyarrow dataset over the data files
with Hive partitioning (the directories alone)."""

from __future__ import annotations

import glob
import json
import os
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.dataset as ds
import pytest
from deltalake import DeltaTable, write_deltalake

from onceflow.checkpoint.eventlog import EventLog
from onceflow.errors import ConfigError
from onceflow.job import CheckpointConfig, Job
from onceflow.runtime.restart import fixed_delay
from onceflow.sinks.delta import DeltaSink

WRITERS = ["arrow", "jvm"]

# k: strings with null, the empty string (a null partition value, as in Delta's protocol) and
# characters Hive escapes in directory names; d: a date; n: an integer.
ROWS = ("id", "CASE WHEN id % 5 = 0 THEN NULL WHEN id % 5 = 1 THEN '' WHEN id % 5 = 2 THEN 'a/b:c=%' "
        "ELSE CAST(id % 3 AS STRING) END AS k", "date_add(DATE'2024-02-28', CAST(id % 2 AS INT)) AS d",
        "CAST(id % 4 AS INT) AS n")


HIVE_DIR = {None: "__HIVE_DEFAULT_PARTITION__", "a/b:c=%": "a%2Fb%3Ac%3D%25"}


def expected_k(i: int) -> str | None:
    return {0: None, 1: None, 2: "a/b:c=%"}.get(i % 5, str(i % 3))


def job(tmp_path, sink: DeltaSink, total: int = 3000, select=ROWS, per_batch: int = 1000, name: str = "p",
        ckpt: str = "ckpt", **kw) -> Job:
    def source(spark):
        return (spark.readStream.format("onceflow-sequence").option("total", total)
                .option("rows_per_second", 10**9).option("max_rows_per_batch", per_batch).load())

    return Job(name=name, source=source, transform=lambda df: df.selectExpr(*select), sink=sink,
               checkpoint=CheckpointConfig(str(tmp_path / ckpt), interval=0),
               restart_strategy=fixed_delay(attempts=3, delay=0), stop_when_idle=1.0, **kw)


def log_actions(table, kind: str) -> list[dict]:
    out = []
    for entry in sorted(glob.glob(f"{table}/_delta_log/*.json")):
        with open(entry) as f:
            out += [line[kind] for line in map(json.loads, f) if kind in line]
    return out


def check_partitioned(table, total: int, columns=("k", "d")) -> None:
    """Every id once with its own partition values, through delta-rs, the raw log and the
    directories (pyarrow's Hive partitioning)."""
    from datetime import date

    t = DeltaTable(str(table))
    assert t.metadata().partition_columns == list(columns)
    rows = t.to_pyarrow_table().to_pylist()
    assert sorted(r["id"] for r in rows) == list(range(total))
    for r in rows:
        assert r["k"] == expected_k(r["id"]), r
        assert r["d"] == date(2024, 2, 28 + r["id"] % 2), r
    adds = log_actions(table, "add")
    assert adds and all(set(a["partitionValues"]) == set(columns) for a in adds)
    assert {a["partitionValues"]["k"] for a in adds} == {None, "0", "1", "2", "a/b:c=%"}
    assert {a["partitionValues"]["d"] for a in adds} == {"2024-02-28", "2024-02-29"}
    for a in adds:  # Hive-style directories named after the logged values (the path is a URI)
        path = unquote(a["path"])
        segments = path.split("/")
        k = a["partitionValues"]["k"]
        assert segments[1] == f"k={HIVE_DIR.get(k, k)}", a["path"]
        assert segments[2] == f"d={a['partitionValues']['d']}"
        assert os.path.isfile(os.path.join(table, path))
    files = ds.dataset(t.file_uris(), format="parquet", partitioning="hive").to_table()
    assert "k" in files.column_names and sorted(files.column("id").to_pylist()) == list(range(total))
    for i, k in zip(files.column("id").to_pylist(), files.column("k").to_pylist(), strict=True):
        assert k == expected_k(i)


@pytest.mark.parametrize("writer", WRITERS)
def test_partition_by_creates_a_partitioned_table_read_back_by_independent_readers(spark, tmp_path, writer):
    table = tmp_path / "table"
    job(tmp_path, DeltaSink(str(table), partition_by=["k", "d"], writer=writer), per_batch=1500).run(spark=spark)
    check_partitioned(table, 3000)
    from onceflow.verify.readers import delta_dangling

    assert delta_dangling(str(table)) == []


@pytest.mark.parametrize("writer", WRITERS)
def test_an_existing_partitioned_table_gets_its_partition_values(spark, tmp_path, writer):
    """A table created elsewhere, partitioned by k and d: the sink (no partition_by) writes in
    that partitioning (before: adds with empty partitionValues, rows read back with null k)."""
    table = tmp_path / "table"
    from datetime import date

    write_deltalake(str(table), pa.table({"id": pa.array([], pa.int64()), "k": pa.array([], pa.string()),
                                          "d": pa.array([], pa.date32())}), partition_by=["k", "d"])
    job(tmp_path, DeltaSink(str(table), writer=writer), select=ROWS[:3]).run(spark=spark)
    check_partitioned(table, 3000)
    assert date(2024, 2, 29) in DeltaTable(str(table)).to_pyarrow_table().column("d").to_pylist()


@pytest.mark.parametrize("writer", WRITERS)
def test_a_conflicting_partition_by_is_refused_in_one_line(spark, tmp_path, writer):
    table = tmp_path / "table"
    write_deltalake(str(table), pa.table({"id": pa.array([1], pa.int64()), "k": ["x"]}), partition_by=["k"])
    with pytest.raises(ConfigError, match=r"partition_by=\['id'\] but table .* is partitioned by \['k'\]") as e:
        job(tmp_path, DeltaSink(str(table), partition_by=["id"], writer=writer), select=ROWS[:2]).run(spark=spark)
    assert "\n" not in str(e.value)
    plain = tmp_path / "plain"
    write_deltalake(str(plain), pa.table({"id": pa.array([1], pa.int64()), "k": ["x"]}))
    with pytest.raises(ConfigError, match=r"partition_by=\['k'\] but table .* is partitioned by \[\]"):
        job(tmp_path, DeltaSink(str(plain), partition_by=["k"], writer=writer), select=ROWS[:2],
            ckpt="ckpt2").run(spark=spark)
    assert DeltaTable(str(table)).version() == 0 and DeltaTable(str(plain)).version() == 0
    with pytest.raises(ConfigError, match="not columns of the stream"):
        job(tmp_path, DeltaSink(str(tmp_path / "new"), partition_by=["nope"], writer=writer), select=ROWS[:2],
            ckpt="ckpt3").run(spark=spark)
    with pytest.raises(ConfigError, match="partition column v has type double"):
        job(tmp_path, DeltaSink(str(tmp_path / "new2"), partition_by=["v"], writer=writer),
            select=("id", "CAST(id AS DOUBLE) AS v"), ckpt="ckpt4").run(spark=spark)


def test_a_decision_for_another_partitioning_commits_nothing(tmp_path):
    """The safety net at the decision: files written for one partitioning are never added to
    a table that has another (the table was replaced between the tasks' writes and decide)."""
    import uuid

    from pyspark.sql.types import LongType, StringType, StructField, StructType

    from onceflow.errors import SinkError
    from onceflow.sinks.base import Decision

    table = tmp_path / "table"
    write_deltalake(str(table), pa.table({"id": pa.array([1], pa.int64()), "k": ["x"]}), partition_by=["k"])
    src = DeltaSink(str(table)).data_source()
    schema = StructType([StructField("id", LongType()), StructField("k", StringType())])
    src.write_schema = schema
    lineage = str(uuid.uuid4())
    epoch = src.open(lineage)
    version = DeltaTable(str(table)).version()
    name = f"part-of-{lineage}-e{epoch}-b0000000000-p00000-a0-0123456789ab.parquet"
    (table / name).write_bytes(b"")
    handle = {"path": name, "size": 0, "rows": 1, "mtime": 0}
    with pytest.raises(SinkError, match=r"partitioned by \['k'\] but the batch's files"):
        src.decide(Decision(lineage, 0, "fp", [handle], epoch), schema, False)
    assert DeltaTable(str(table)).version() == version


# ---- schema evolution ----------------------------------------------------------------------------


def test_strict_schema_names_the_differing_columns_and_the_option(spark, tmp_path):
    table = tmp_path / "table"
    write_deltalake(str(table), pa.table({"id": pa.array([0], pa.int64()), "gone": pa.array([1], pa.int32()),
                                          "n": pa.array([1], pa.int16())}))
    with pytest.raises(ConfigError) as e:
        job(tmp_path, DeltaSink(str(table)), select=("id", "CAST(id AS INT) AS n", "'x' AS extra")).run(spark=spark)
    msg = str(e.value)
    assert "new column(s) extra" in msg and "missing column(s) gone" in msg and "n (int32 vs table int16)" in msg
    assert "schema_mode='merge'" in msg and DeltaTable(str(table)).version() == 0


@pytest.mark.parametrize("writer", WRITERS)
def test_merge_adds_columns_in_the_decision_commit_and_a_replay_commits_once(spark, tmp_path, writer):
    """v1 of the stream writes (id, n int); v2 adds a string column s and a partition of it, and
    n arrives as smallint (widened to int). The new column appears in the very commit that adds
    the first v2 batch (metaData + adds + app transaction in one log entry), exactly once although
    that batch's first attempt fails right after its decision (a replay)."""
    table = tmp_path / "table"
    sink = DeltaSink(str(table), writer=writer, partition_by=["p"])
    v1 = ("id", "CAST(id % 7 AS INT) AS n", "CAST(id % 2 AS INT) AS p")
    job(tmp_path, sink, total=2000, select=v1).run(spark=spark)
    before = DeltaTable(str(table)).version()
    first_v2 = 1 + max(e["batch"] for e in EventLog(str(tmp_path / "ckpt")).read() if e["event"] == "sink_commit")

    v2 = ("id", "CAST(id % 7 AS SMALLINT) AS n", "CAST(id % 2 AS INT) AS p", "CONCAT('s', id) AS s")
    merged = DeltaSink(str(table), writer=writer, schema_mode="merge")
    markers = tmp_path / "markers"
    markers.mkdir()
    opts = merged.options() | {"test_crash_at": f"after_decide@{first_v2}:raise", "test_crash_markers": str(markers)}
    merged.options = lambda: opts  # type: ignore[method-assign]
    job(tmp_path, merged, total=4000, select=v2).run(spark=spark)
    assert os.listdir(markers), "the fault after the decision never fired"

    t = DeltaTable(str(table))
    rows = t.to_pyarrow_table()
    assert rows.schema.field("n").type == pa.int32() and rows.schema.field("s").type == pa.string()
    got = sorted(rows.to_pylist(), key=lambda r: r["id"])
    assert [r["id"] for r in got] == list(range(4000)), "every id exactly once"
    assert all(r["s"] == (None if r["id"] < 2000 else f"s{r['id']}") and r["n"] == r["id"] % 7 for r in got)
    entries = sorted(glob.glob(f"{table}/_delta_log/*.json"))[before + 1:]
    with_meta = [e for e in entries if any("metaData" in json.loads(line) for line in open(e))]
    assert len(with_meta) == 1, with_meta
    kinds = [next(iter(json.loads(line))) for line in open(with_meta[0])]
    assert "add" in kinds and "txn" in kinds, "the schema change and the batch: one commit"
    schema = json.loads(next(json.loads(line)["metaData"] for line in open(with_meta[0]) if "metaData" in line)
                        ["schemaString"])
    assert [(f["name"], f["nullable"]) for f in schema["fields"]][-1] == ("s", True)


def test_merge_refuses_a_wider_type_and_a_missing_required_column(spark, tmp_path):
    table = tmp_path / "table"
    write_deltalake(str(table), pa.table({"id": pa.array([0], pa.int64()), "n": pa.array([1], pa.int16())}))
    with pytest.raises(ConfigError, match=r"n \(int32 vs table int16: widening a table column needs Delta's "
                                          r"typeWidening feature\)"):
        job(tmp_path, DeltaSink(str(table), schema_mode="merge"), select=("id", "CAST(id AS INT) AS n")).run(spark=spark)
    assert DeltaTable(str(table)).version() == 0
    required = tmp_path / "required"
    write_deltalake(str(required), pa.table({"id": pa.array([0], pa.int64()), "r": pa.array([1], pa.int64())},
                                            schema=pa.schema([("id", pa.int64()), pa.field("r", pa.int64(), False)])))
    with pytest.raises(ConfigError, match=r"no value for non-nullable table column\(s\) r"):
        job(tmp_path, DeltaSink(str(required), schema_mode="merge"), select=("id",), ckpt="ckpt2").run(spark=spark)
    assert DeltaTable(str(required)).version() == 0
    with pytest.raises(ConfigError, match="use 'strict' or 'merge'"):
        DeltaSink(str(table), schema_mode="evolve")  # type: ignore[arg-type]


def test_complete_mode_replaces_a_partitioned_table_through_delta_rs(tmp_path):
    """complete mode commits through delta-rs (not the local log): the same partition values
    and directory names, the escaped value's path stored once-encoded, the old batch removed."""
    import uuid

    from pyspark.sql.types import LongType, StringType, StructField, StructType

    from onceflow.sinks.base import Decision, TaskInfo

    table = tmp_path / "table"
    schema = StructType([StructField("id", LongType()), StructField("k", StringType())])
    src = DeltaSink(str(table), partition_by=["k"]).data_source()
    src.write_schema = schema
    src.validate(schema, True)
    lineage = str(uuid.uuid4())
    epoch = src.open(lineage)
    for b in range(2):
        rows = pa.record_batch({"id": pa.array([10 * b, 10 * b + 1, 10 * b + 2], pa.int64()),
                                "k": ["a/b:c=%", None, "x"]})
        handle, n = src.pre_commit(TaskInfo(lineage, b, 0, 0), schema, True, iter([rows]))
        assert n == 3 and len(handle["files"]) == 3
        decision = Decision(lineage, b, f"fp{b}", [handle], epoch)
        src.decide(decision, schema, True)
        src.commit(decision)
    got = sorted(DeltaTable(str(table)).to_pyarrow_table().to_pylist(), key=lambda r: r["id"])
    assert got == [{"id": 10, "k": "a/b:c=%"}, {"id": 11, "k": None}, {"id": 12, "k": "x"}]
    last = sorted(glob.glob(f"{table}/_delta_log/*.json"))[-1]
    adds = [json.loads(line)["add"] for line in open(last) if '"add"' in line]
    assert {a["partitionValues"]["k"] for a in adds} == {"a/b:c=%", None, "x"}
    for a in adds:
        assert os.path.isfile(os.path.join(table, unquote(a["path"]))), a["path"]
