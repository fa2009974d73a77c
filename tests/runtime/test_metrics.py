"""``onceflow run --metrics-port``: Prometheus metrics of a live driver, scraped by a real
Prometheus server; the in-memory figures (no event-log read per scrape), failed batches,
freshness, source lag, state size on the checkpoint, and the shipped alerting rules. The
driver run also checks ``--master``/``--conf`` over the job's own settings."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from onceflow.checkpoint.eventlog import EventLog

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

JOB = textwrap.dedent(
    """
    import json, os
    from onceflow import CheckpointConfig, DeltaSink, Job, fixed_delay

    def source(spark):
        sc = spark.sparkContext
        with open(os.environ["WORK"] + "/session.json", "w") as f:
            json.dump({"master": sc.master, "ui": sc.uiWebUrl,
                       "shuffle": spark.conf.get("spark.sql.shuffle.partitions"),
                       "tz": spark.conf.get("spark.sql.session.timeZone")}, f)
        return (spark.readStream.format("onceflow-sequence").option("total", 20000)
                .option("rows_per_second", 1000).option("max_rows_per_batch", 1000).load())

    job = Job(name="metered", source=source, sink=DeltaSink(os.environ["WORK"] + "/table"),
              checkpoint=CheckpointConfig(os.environ["WORK"] + "/ckpt", interval=0),
              restart_strategy=fixed_delay(attempts=1, delay=0), stop_when_idle=1.0,
              master="local[2]", spark_conf={"spark.sql.shuffle.partitions": "5"})
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape_text(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def _scrape(port: int) -> dict[str, float]:
    """Samples by name (labels dropped: the last sample of a name wins)."""
    out = {}
    for line in _scrape_text(port).splitlines():
        if line.startswith("onceflow_"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
    return out


def _types(text: str) -> dict[str, str]:
    return {ln.split()[2]: ln.split()[3] for ln in text.splitlines() if ln.startswith("# TYPE ")}


def _prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if not found or not shutil.which("promtool"):
        pytest.fail("prometheus/promtool not installed (Debian package 'prometheus'): run ./setup.sh test")
    return found


def _query(prom: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    body = json.loads(urllib.request.urlopen(url, timeout=5).read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def _start_prometheus(tmp_path: Path, target_port: int) -> tuple[subprocess.Popen, int]:
    prom_port = _free_port()
    (tmp_path / "prometheus.yml").write_text(textwrap.dedent(f"""
        global: {{scrape_interval: 1s, evaluation_interval: 1s}}
        rule_files: [{DEPLOY / 'alerts.yml'}]
        scrape_configs:
          - job_name: onceflow
            static_configs: [{{targets: ['127.0.0.1:{target_port}']}}]
        """))
    proc = subprocess.Popen(
        [_prometheus_binary(), f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))
    return proc, prom_port


def test_a_real_prometheus_scrapes_the_active_driver_and_the_command_line_wins(tmp_path):
    """A real job (onceflow-sequence -> Delta, ``onceflow run --metrics-port``) scraped every
    second by a real Prometheus server loaded with deploy/alerts.yml; its HTTP API must see the
    new metric names with sane values while the job runs. Old code: no onceflow_batches_total,
    onceflow_last_commit_age_seconds, ... (only Flink's camelCase gauges)."""
    (tmp_path / "job.py").write_text(JOB)
    port = _free_port()
    prom, prom_port = _start_prometheus(tmp_path, port)
    env = {k: v for k, v in os.environ.items() if k != "ONCEFLOW_SPARK_CONF"}  # the user's default: UI on
    env["WORK"] = str(tmp_path)
    sup = subprocess.Popen([sys.executable, "-m", "onceflow", "run", "--no-standby", "--no-savepoint-on-stop",
                            "--metrics-port", str(port),
                            "--master", "local[1]", "--conf", "spark.ui.port=4077",
                            "--conf", "spark.sql.shuffle.partitions=3", str(tmp_path / "job.py")],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[str, float] = {}
    try:
        deadline, m = time.monotonic() + 180, {}
        while time.monotonic() < deadline:
            assert sup.poll() is None, f"job ended: scraped {m}; Prometheus saw {seen}; {sup.communicate()[1][-2000:]}"
            assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            try:
                m = _scrape(port)
                seen = {r["metric"]["__name__"]: float(r["value"][1]) for r in _query(
                    prom_port, '{__name__=~"onceflow_(batches|records_out|batches_failed|lease_lost)_total'
                               '|onceflow_last_commit_age_seconds|onceflow_uptime_seconds'
                               '|onceflow_batch_duration_seconds_count|onceflow_commit_duration_seconds_count"}')}
            except OSError:
                pass
            if (m.get("onceflow_job_numberOfCompletedCheckpoints", 0) >= 3 and m.get("onceflow_records_out_total", 0) > 0
                    and seen.get("onceflow_batches_total", 0) >= 3 and seen.get("onceflow_records_out_total", 0) > 0
                    and seen.get("onceflow_commit_duration_seconds_count", 0) > 0):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"no committed batches in the metrics: {m}; Prometheus saw {seen}")
        text = _scrape_text(port)
        ups = _query(prom_port, 'up{job="onceflow"}')
        # every dashboard query parses and runs on the stored data
        dash = json.loads((DEPLOY / "grafana-onceflow.json").read_text())
        for expr in (t["expr"] for p in dash["panels"] for t in p.get("targets", [])):
            _query(prom_port, expr.replace("$__rate_interval", "1m").replace("$job_name", ".*"))
        assert _query(prom_port, 'onceflow_batch_duration_seconds_bucket{le="+Inf"}')
    finally:
        sup.terminate()
        sup.communicate(timeout=120)
        prom.terminate()
        prom.wait(timeout=30)
    # What Prometheus stored from its scrapes: sane values, with the job's name as job_name
    assert ups and ups[0]["value"][1] == "1", ups
    assert seen["onceflow_batches_total"] >= 3 and seen["onceflow_records_out_total"] > 0
    assert seen["onceflow_batch_duration_seconds_count"] >= 3, seen
    assert 0 <= seen["onceflow_last_commit_age_seconds"] < 30, seen
    assert seen["onceflow_batches_failed_total"] == 0 and seen["onceflow_lease_lost_total"] == 0
    assert 0 < seen["onceflow_uptime_seconds"] < 300
    types = _types(text)
    assert types["onceflow_batches_total"] == "counter" and types["onceflow_records_in_total"] == "counter"
    assert types["onceflow_batch_duration_seconds"] == "histogram", types
    assert types["onceflow_commit_duration_seconds"] == "histogram"
    assert 'job_name="metered"' in text
    # Flink's names stay (docs/metrics.md maps them); In can trail Out by the last batch
    assert m["onceflow_job_numRecordsIn_total"] > 0 and m["onceflow_job_numRecordsOut_total"] > 0
    assert m["onceflow_job_uptime"] > 0 and m["onceflow_job_numRestarts"] == 0
    assert m["onceflow_job_lastCheckpointDuration"] > 0
    for name in ("numberOfFailedCheckpoints", "lastCheckpointSize", "replayedRecordsSkipped_total",
                 "replayedBatchesSkipped_total"):
        assert f"onceflow_job_{name}" in m, name

    session = json.loads((tmp_path / "session.json").read_text())
    assert session["master"] == "local[1]"  # --master over Job.master
    assert session["shuffle"] == "3"  # --conf over Job.spark_conf over onceflow's default (4)
    assert session["tz"] == "UTC"  # onceflow's default where nobody said otherwise
    assert session["ui"] and ":40" in session["ui"], session  # the UI is on, at 4077 or the next free port


def test_the_shipped_alerting_rules_load_and_pass_their_unit_tests():
    """deploy/alerts.yml (no commit, restarts increasing, lease lost...) is valid and its
    promtool unit tests pass. Old code: no deploy/ folder."""
    _prometheus_binary()
    check = subprocess.run(["promtool", "check", "rules", str(DEPLOY / "alerts.yml")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    for alert in ("OnceflowNoCommit", "OnceflowRestarting", "OnceflowLeaseLost", "OnceflowSourceLagGrowing",
                  "OnceflowSourceBehind"):
        assert alert in (DEPLOY / "alerts.yml").read_text()
    unit = subprocess.run(["promtool", "test", "rules", str(DEPLOY / "alerts_test.yml")],
                          capture_output=True, text=True, timeout=60)
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr


def test_the_grafana_dashboard_uses_only_exported_metrics():
    """deploy/grafana-onceflow.json: valid JSON whose panels query metrics the collector
    exports (throughput, commit age, lag, durations, restarts, state size)."""
    import re

    dash = json.loads((DEPLOY / "grafana-onceflow.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    names = {n for e in exprs for n in re.findall(r"onceflow_[a-z_]+", e)}
    exported = {"onceflow_batches_total", "onceflow_batches_failed_total", "onceflow_restarts_total",
                "onceflow_lease_lost_total", "onceflow_records_in_total", "onceflow_records_out_total",
                "onceflow_replayed_batches_skipped_total", "onceflow_replayed_records_skipped_total",
                "onceflow_last_commit_age_seconds", "onceflow_last_batch_id", "onceflow_uptime_seconds",
                "onceflow_source_lag_records", "onceflow_source_lag_seconds", "onceflow_state_checkpoint_bytes",
                "onceflow_state_rows",
                "onceflow_state_memory_bytes", "onceflow_last_commit_timestamp_seconds",
                "onceflow_newest_event_timestamp_seconds", "onceflow_newest_event_age_seconds"}
    exported |= {f"onceflow_{h}_duration_seconds_{s}" for h in ("batch", "commit") for s in ("bucket", "sum", "count")}
    assert names and names <= exported, names - exported
    for wanted in ("onceflow_records_out_total", "onceflow_last_commit_age_seconds", "onceflow_source_lag_records",
                   "onceflow_source_lag_seconds",
                   "onceflow_batch_duration_seconds_bucket", "onceflow_commit_duration_seconds_bucket",
                   "onceflow_restarts_total", "onceflow_state_checkpoint_bytes", "onceflow_newest_event_age_seconds"):
        assert wanted in names, wanted


# ---- in-memory figures from events (no Spark) ----------------------------------------------


def _history(ckpt: str) -> EventLog:
    """An event log as other processes leave it: an earlier driver, the supervisor, the sink's
    commit process (pids other than this test's)."""
    log = EventLog(ckpt)
    other = {"pid": 1}
    log.append("batch", batch=0, input_rows=100, duration_ms=50, state_bytes=7, **other)
    log.append("sink_commit", batch=0, rows=100, replay=False, commit_s=0.02, **other)
    log.append("restart", cause="killed by SIGKILL", scope="process", **other)  # a driver crash while idle
    log.append("batch", batch=0, input_rows=100, duration_ms=40, **other)  # the replay
    log.append("sink_commit", batch=0, rows=0, replay=True, commit_s=0.01, **other)
    log.append("failed", cause="lease taken", error="LeaseLost", **other)
    return log


def test_failed_batches_are_batches_that_failed_not_restarts(tmp_path):
    """Old code: numberOfFailedCheckpoints counted every restart (1 here: a driver process
    killed while idle) and there was no onceflow_batches_failed_total."""
    from onceflow.runtime.metrics import serve

    ckpt = str(tmp_path / "ckpt")
    log = _history(ckpt)
    port = _free_port()
    serve(port, ckpt, "j", started=time.time() - 5)
    deadline = time.monotonic() + 10
    while _scrape(port).get("onceflow_job_numRestarts", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    m = _scrape(port)
    assert m["onceflow_job_numRestarts"] == 1 and m["onceflow_job_numberOfFailedCheckpoints"] == 0
    assert m["onceflow_batches_failed_total"] == 0
    log.append("batch_failed", batch=1, cause="boom", pid=1)
    log.append("restart", cause="boom", scope="query", pid=1)
    time.sleep(0.1)
    from onceflow.runtime import metrics as mod

    next(f for u, (_, f) in mod._SERVED.items() if u.endswith(str(tmp_path / "ckpt"))).wake()
    while _scrape(port).get("onceflow_batches_failed_total", 0) < 1 and time.monotonic() < deadline + 10:
        time.sleep(0.1)
    text = _scrape_text(port)
    assert 'onceflow_restarts_total{job_name="j",scope="process"} 1.0' in text
    assert 'onceflow_restarts_total{job_name="j",scope="query"} 1.0' in text
    m = _scrape(port)
    assert m["onceflow_batches_failed_total"] == 1 and m["onceflow_job_numberOfFailedCheckpoints"] == 1
    assert m["onceflow_lease_lost_total"] == 1


def test_a_scrape_reads_memory_only_and_the_drivers_own_events_count_at_once(tmp_path, monkeypatch):
    """Old code tailed the event log at every scrape (a listing per scrape on object stores)."""
    from onceflow.runtime import metrics

    ckpt = str(tmp_path / "ckpt")
    _history(ckpt)
    port = _free_port()
    jm = metrics.serve(port, ckpt, "j")
    deadline = time.monotonic() + 10
    while _scrape(port).get("onceflow_job_numRestarts", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)  # the history is in (read once by the follower)
    reads = []  # reads of the log outside the follower's thread (which tails after batches)

    def counted(name, real):
        def read(self, *a, **k):
            import threading

            if threading.current_thread().name != "onceflow-metrics-follower":
                reads.append(name)
            return real(self, *a, **k)
        return read

    for name in ("tail", "read", "_lines_from", "_names", "size"):
        monkeypatch.setattr(EventLog, name, counted(name, getattr(EventLog, name)))
    for _ in range(20):
        _scrape_text(port)
    assert reads == [], reads
    # The runner's own appends (through metrics.event_log) count at once, without a read
    log = metrics.event_log(ckpt)
    assert isinstance(log, metrics.ObservedEventLog)
    t0 = time.time()
    log.append("batch", batch=1, input_rows=10, duration_ms=1500, newest_event_ts=t0 - 30.0,
               lag={"orders": {"0": 5, "1": 0}},
               state=[{"id": 0, "name": "dedupe", "rows": 2000, "memory_bytes": 4_202_880,
                       "checkpoint_bytes": 123_456}], state_bytes=123_456, state_batch=1)
    reads.clear()
    text = _scrape_text(port)
    assert reads == [] and jm.batches == 3 and jm.records_in == 210
    assert 'onceflow_source_lag_records{job_name="j",partition="0",topic="orders"} 5.0' in text
    assert 'onceflow_state_checkpoint_bytes{job_name="j",name="dedupe",operator="0"} 123456.0' in text
    assert 'onceflow_state_rows{job_name="j",name="dedupe",operator="0"} 2000.0' in text
    assert 'onceflow_batch_duration_seconds_bucket{job_name="j",le="2.5"} 3.0' in text
    assert 'onceflow_batch_duration_seconds_bucket{job_name="j",le="1.0"} 2.0' in text
    assert 'onceflow_commit_duration_seconds_count{job_name="j"} 2.0' in text
    m = _scrape(port)
    assert m["onceflow_job_lastCheckpointSize"] == 123_456
    assert m["onceflow_last_commit_age_seconds"] <= time.time() - t0 + 0.5
    assert m["onceflow_newest_event_timestamp_seconds"] == t0 - 30.0
    assert 30.0 <= m["onceflow_newest_event_age_seconds"] <= time.time() - t0 + 30.5
    assert m["onceflow_records_out_total"] == 100 and m["onceflow_replayed_batches_skipped_total"] == 1
    assert m["onceflow_replayed_records_skipped_total"] == 100
    time.sleep(1.0)  # the age is computed at scrape time
    assert _scrape(port)["onceflow_last_commit_age_seconds"] >= 1.0


def test_a_half_written_line_is_read_once_complete(tmp_path):
    from onceflow.runtime.metrics import Follower, JobMetrics

    ckpt = str(tmp_path / "ckpt")
    log = _history(ckpt)
    jm = JobMetrics("j", started=time.time())
    follower = Follower(EventLog(ckpt), jm)
    with open(log.path, "a") as f:
        f.write('{"ts": 1, "pid": 1, "event": "batch", "batch": 1, "input_rows": 5')  # still being written
    follower.step()
    assert (jm.batches, sum(jm.restarts.values()), jm.batches_failed, jm.records_in, jm.records_out) == (2, 1, 0, 200, 100)
    assert (jm.replay_batches, jm.replay_records, jm.last_duration_ms) == (1, 100, 40)
    with open(log.path, "a") as f:
        f.write(', "duration_ms": 30}\n')
    follower.step()
    assert (jm.batches, jm.records_in, jm.last_duration_ms) == (3, 205, 30)


def test_source_lag_per_topic_and_partition_from_spark_progress():
    """Kafka-shaped offsets: latest (reported when the batch was planned) minus its end."""
    from onceflow.runtime.metrics import source_lag, state_operators

    progress = {"sources": [
        {"endOffset": '{"orders": {"0": 10, "1": 7}}', "latestOffset": '{"orders": {"0": 25, "1": 7}}'},
        {"endOffset": '{"next": 100}', "latestOffset": '{"next": 150}'},  # not per partition: no lag
        {"endOffset": '{"shards": "x"}', "latestOffset": None},
    ], "stateOperators": [{"operatorName": "dedupe", "numRowsTotal": 3, "memoryUsedBytes": 99}]}
    assert source_lag(progress) == {"orders": {"0": 15, "1": 0}}
    assert source_lag({"sources": [{"endOffset": '{"next": 1}', "latestOffset": '{"next": 2}'}]}) is None
    assert state_operators(progress) == [{"id": 0, "name": "dedupe", "rows": 3, "memory_bytes": 99}]


# ---- state size on the checkpoint and failed batches (real Spark, in this process) ---------


def test_state_size_is_the_checkpoints_bytes_per_operator_and_a_failed_batch_is_logged(spark, tmp_path, monkeypatch):
    """A deduplication keeping 2,000 keys, then one keeping 20,000 (whose batch 0 fails once
    in the sink's commit). Old code: the batch events' state_bytes was Spark's in-memory
    estimate (373,760 and 3,297,216 bytes here; 11,503 and 102,953 on the checkpoint), with no
    per-operator ``state``; nothing logged the failed batch (it only counted as a restart);
    ``onceflow checkpoints`` had no size per operator."""
    from click.testing import CliRunner

    from onceflow.checkpoint.layout import CheckpointDir
    from onceflow.cli.main import main
    from onceflow.job import CheckpointConfig, Job
    from onceflow.runtime.metrics import checkpoint_state_bytes
    from onceflow.runtime.restart import fixed_delay
    from onceflow.sinks.delta import DeltaSink

    class CrashingDeltaSink(DeltaSink):
        def __init__(self, path, rule, markers):
            super().__init__(path)
            self.rule, self.markers = rule, markers

        def options(self):
            return {**super().options(), "test_crash_at": self.rule, "test_crash_markers": self.markers}

    monkeypatch.setenv("ONCEFLOW_STATE_SIZE_EVERY_S", "0")
    (tmp_path / "m").mkdir()
    last = {}
    for keys in (2000, 20000):
        ckpt, table = str(tmp_path / f"ckpt{keys}"), str(tmp_path / f"t{keys}")
        sink = DeltaSink(table) if keys == 2000 else CrashingDeltaSink(table, "before_decide@0:raise", str(tmp_path / "m"))
        Job(name=f"dedupe{keys}",
            source=lambda spark, k=keys: (spark.readStream.format("onceflow-sequence").option("total", 20000)
                                          .option("keys", k).option("rows_per_second", 10**9)
                                          .option("max_rows_per_batch", 20000).load()),
            transform=lambda df: df.dropDuplicates(["key"]), sink=sink,
            checkpoint=CheckpointConfig(ckpt, interval=0), restart_strategy=fixed_delay(attempts=1, delay=0),
            stop_when_idle=1.0).run(spark=spark)
        events = list(EventLog(ckpt).read())
        batch = [e for e in events if e["event"] == "batch"][-1]
        assert batch["batch"] >= 0 and batch["state_batch"] == batch["batch"], batch
        (op,) = batch["state"]
        assert op["rows"] == keys and op["id"] == 0, op
        on_ckpt = checkpoint_state_bytes(CheckpointDir(ckpt), batch["batch"])
        assert batch["state_bytes"] == op["checkpoint_bytes"] == on_ckpt[0] > 0, (batch, on_ckpt)
        last[keys] = batch["state_bytes"]
        failed = [e for e in events if e["event"] == "batch_failed"]
        restarts = [e for e in events if e["event"] == "restart"]
        if keys == 2000:
            assert failed == [] and restarts == []
        else:
            assert [e["batch"] for e in failed] == [0] and len(restarts) == 1, failed
            assert failed[0]["cause"] == restarts[0]["cause"], (failed, restarts)
        out = CliRunner().invoke(main, ["checkpoints", ckpt])
        assert out.exit_code == 0, out.output
        assert f"{on_ckpt[0]:,} bytes on the checkpoint, {keys:,} keys" in out.output, out.output
    assert last[20000] > 5 * last[2000], last


def test_each_batch_event_has_the_newest_event_time_it_read_and_a_wrong_column_is_named(spark, tmp_path):
    """The sequence source's ``event_time`` is its id in milliseconds: 5,000 ids in batches of
    2,000 end at 1.999 s, 3.999 s and 4.999 s, and each batch event says so (Spark's observe on
    the source's first timestamp column); the gauge keeps the newest. A named column that is
    missing or not a timestamp is refused before the query starts. Old code: no
    ``newest_event_ts``, and ``event_time`` was not an option."""
    from onceflow.errors import ConfigError
    from onceflow.job import CheckpointConfig, Job
    from onceflow.runtime.metrics import JobMetrics
    from onceflow.sinks.delta import DeltaSink

    def source(s):
        return (s.readStream.format("onceflow-sequence").option("total", 5000).option("rows_per_second", 10**9)
                .option("max_rows_per_batch", 2000).load())

    ckpt = str(tmp_path / "ckpt")
    Job(name="fresh", source=source, sink=DeltaSink(str(tmp_path / "t")), checkpoint=CheckpointConfig(ckpt, interval=0),
        stop_when_idle=1.0).run(spark=spark)
    events = list(EventLog(ckpt).read())
    batches = [e for e in events if e["event"] == "batch" and e["input_rows"]]
    assert [(b["input_rows"], b["newest_event_ts"]) for b in batches] == [(2000, 1.999), (2000, 3.999), (1000, 4.999)]
    jm = JobMetrics("fresh")
    for e in events:
        jm.apply(e)
    assert jm.newest_event_ts == 4.999 and jm.event_age_s(now=10.0) == 10.0 - 4.999
    for column, says in (("created", "has no such column (it has id, key, event_time)"), ("id", "is a bigint, not a timestamp")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            Job(name="wrong", source=source, sink=DeltaSink(str(tmp_path / "w")), event_time=column,
                checkpoint=CheckpointConfig(str(tmp_path / "w-ckpt"))).dataframe(spark)


def test_kafka_lag_per_partition_is_in_the_batch_events(spark, tmp_path):
    """A Kafka job capped at 20 records per batch over partitions holding 30 and 10 records:
    the first batch's event says how many records each partition still held (Spark's latest
    offsets from the source minus the batch's end), the last one 0. Old code: no ``lag``."""
    from kafka_broker import KafkaBroker, create_topic, produce
    from onceflow.job import CheckpointConfig, Job
    from onceflow.sinks.delta import DeltaSink
    from onceflow.sources.kafka import KafkaSource

    with KafkaBroker() as broker:
        create_topic(broker.bootstrap, "lagging", 2)
        produce(broker.bootstrap, "lagging", [f"a{i}" for i in range(30)], partition=0)
        produce(broker.bootstrap, "lagging", [f"b{i}" for i in range(10)], partition=1)
        source = KafkaSource(broker.bootstrap, topics="lagging", starting_offsets="earliest",
                             max_offsets_per_trigger=20)
        ckpt = str(tmp_path / "ckpt")
        Job(name="lag", source=source.load, transform=lambda df: df.selectExpr("CAST(value AS STRING) AS v"),
            sink=DeltaSink(str(tmp_path / "t")), checkpoint=CheckpointConfig(ckpt, interval=0),
            stop_when_idle=1.0).run(spark=spark)
    batches = [e for e in EventLog(ckpt).read() if e["event"] == "batch" and e["input_rows"]]
    assert [b["input_rows"] for b in batches] == [20, 20], batches
    assert batches[0]["lag"] == {"lagging": {"0": 15, "1": 5}}, batches[0]  # 20 split 30:10 -> 15 + 5
    assert batches[-1]["lag"] == {"lagging": {"0": 0, "1": 0}}, batches[-1]


def test_the_state_size_is_listed_at_most_every_n_seconds(tmp_path, monkeypatch):
    """Between two measurements a batch reuses the last figure (no listing per batch)."""
    from onceflow.checkpoint.layout import CheckpointDir
    from onceflow.runtime.metrics import progress

    calls = []
    monkeypatch.setattr(progress, "checkpoint_state_bytes", lambda ckpt, batch: calls.append(batch) or {0: batch})
    size = progress.StateSize(CheckpointDir(str(tmp_path)), every_s=60)
    assert size.after(3) == (3, {0: 3})
    assert size.after(4) == (3, {0: 3}) and calls == [3]
    size.every_s = 0
    assert size.after(5) == (5, {0: 5}) and calls == [3, 5]
