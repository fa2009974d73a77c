"""Recovery time after driver SIGKILLs, with and without the warm standby driver.

One command: ``python benchmarks/bench_recovery.py [--kills N] [--pipelines demo,kafka-pg]
[--modes standby,cold,query] [--seed S]``; the state-size axis: ``--pipelines state --modes
standby [--state-keys 1,200000,2000000]``.

For each pipeline and mode it runs the job under ``onceflow run`` (``--standby`` or
``--no-standby``), SIGKILLs the active driver's whole process group N times at random moments
while data flows (2-5 s after the driver committed its first batch and, with standby, after
the next standby reported ready: the steady state), and reads the event log:

* kill -> next commit (median and max): the first sink commit of the new driver;
* the breakdown of each restart (see ``onceflow checkpoints``): driver ready (lease and
  SparkSession), sink recovered (new fencing epoch + recovery), query started, first batch
  planned, first commit;
* the standby's memory (RSS of its process group, from the ``standby_ready`` event).

Mode ``query`` measures the restart *inside* a live driver instead (the job's in-process
restart strategy): N injected failures (``before_decide@B:raise`` every 8 batches), each
restarting the query on the warm SparkSession.

Pipelines: ``demo`` (the ``onceflow demo`` job: sequence source -> running count per key with
applyInPandasWithState -> Delta), ``kafka-pg`` (Kafka on tansu -> PostgreSQL ``two_phase``,
throwaway cluster) and ``state`` (the state-size axis: sequence source -> ``groupBy(key).count()``
on the RocksDB state store, update mode -> Delta, run once per ``--state-keys`` count, the
kills starting once every key is in the state). Each run ends with an independent exactly-once
check of the output (for ``state``: each key's last count equals its number of events).
Targets (issue 11, this machine): with standby median <= 5 s and max <= 10 s; without <= 15 s.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from onceflow.checkpoint.eventlog import EventLog  # noqa: E402
from onceflow.checkpoint.restarts import Restart, restarts  # noqa: E402
from onceflow.verify.exactly_once import check_delta_table, check_ids  # noqa: E402

KAFKA_PG_JOB = """
import os
from onceflow import CheckpointConfig, Job, PostgresSink, fixed_delay
from onceflow.sources.kafka import KafkaSource

def source(spark):
    return KafkaSource(os.environ["BENCH_BOOTSTRAP"], topics="recovery", starting_offsets="earliest",
                       max_offsets_per_trigger=int(os.environ["BENCH_PER_BATCH"])).load(spark)

job = Job(name="recovery-kafka-pg", source=source,
          transform=lambda df: df.selectExpr("CAST(CAST(key AS STRING) AS BIGINT) AS id").where("id >= 0"),
          sink=PostgresSink(os.environ["BENCH_DSN"], "recovery", mode="two_phase", create_table=True),
          checkpoint=CheckpointConfig(os.environ["BENCH_CKPT"], interval="1 s"),
          restart_strategy=fixed_delay(attempts=100, delay=0), stop_when_idle=4, master="local[2]")
"""


STATE_JOB = """
import os
from onceflow import CheckpointConfig, DeltaSink, Job, fixed_delay

def source(spark):
    per_batch = int(os.environ["BENCH_PER_BATCH"])
    return (spark.readStream.format("onceflow-sequence").option("total", int(os.environ["BENCH_EVENTS"]))
            .option("rows_per_second", per_batch).option("max_rows_per_batch", per_batch)
            .option("keys", int(os.environ["BENCH_KEYS"])).load())

job = Job(name="recovery-state", source=source, output_mode="update",
          transform=lambda df: df.groupBy("key").count(),
          sink=DeltaSink(os.environ["BENCH_TABLE"], writer="jvm"),  # the writer that takes update
          checkpoint=CheckpointConfig(os.environ["BENCH_CKPT"], interval="1 s", state_backend="rocksdb"),
          restart_strategy=fixed_delay(attempts=100, delay=0), stop_when_idle=4, master="local[2]")
"""


#: seconds the replacement standby waits, ready, before the next kill (``--standby-idle``)
STANDBY_IDLE_S = 0.0


def drive(cmd: list[str], env: dict, ckpt: str, kills: int, rng: random.Random, log_path: str,
          standby: bool, after_rows: int = 0) -> list[float]:
    """Run the supervisor; SIGKILL the active driver ``kills`` times while data flows (with
    ``standby``: once the replacement standby is warm, the steady state being measured; with
    ``after_rows``: once the sink committed that many rows, e.g. a state holding every key)."""
    events = EventLog(ckpt)
    kill_times: list[float] = []
    with open(log_path, "w") as out:
        sup = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        next_kill = None
        while sup.poll() is None:
            time.sleep(0.2)
            if len(kill_times) >= kills:
                continue
            ev = list(events.read())
            starts = [e for e in ev if e["event"] == "process_start"]
            # up: this driver committed a batch since it started (and the standby, if any, is ready)
            up = starts and any(e["event"] == "sink_commit" and e["ts"] > starts[-1]["ts"] for e in ev)
            if standby:
                up = up and any(e["event"] == "standby_ready" and e["ts"] > starts[-1]["ts"] for e in ev)
            if after_rows:
                up = up and sum(e.get("input_rows", 0) for e in ev if e["event"] == "batch") >= after_rows
            if not up:
                next_kill = None
                continue
            if next_kill is None:
                next_kill = time.time() + STANDBY_IDLE_S + rng.uniform(2.0, 5.0)
            elif time.time() >= next_kill:
                try:
                    os.killpg(starts[-1]["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    continue
                kill_times.append(time.time())
                print(f"    kill {len(kill_times)}/{kills}: SIGKILL driver group {starts[-1]['pid']}", flush=True)
                next_kill = None
        if sup.wait() != 0:
            raise SystemExit(f"onceflow run exited with {sup.returncode}; see {log_path}")
    return kill_times


def faults(mode: str, n: int, work: str) -> dict:
    """In-process failures for mode ``query``: one injected commit failure every 8 batches."""
    if mode != "query":
        return {}
    os.makedirs(os.path.join(work, "markers"), exist_ok=True)
    return {"ONCEFLOW_CRASH_AT": ",".join(f"before_decide@{8 * (i + 1)}:raise" for i in range(n)),
            "ONCEFLOW_CRASH_MARKER_DIR": os.path.join(work, "markers")}


def run_demo(tmp: str, mode: str, kills: int, rng: random.Random, events_n: int) -> tuple[list[Restart], dict, str]:
    from onceflow.demo import job as demo_job

    standby = mode == "standby"
    work = os.path.join(tmp, f"demo-{mode}")
    env = {**os.environ, "ONCEFLOW_DEMO_DIR": work, "ONCEFLOW_DEMO_EVENTS": str(events_n),
           "ONCEFLOW_DEMO_RATE": "20000", **faults(mode, kills, work)}
    cmd = [sys.executable, "-m", "onceflow", "run", demo_job.__file__, "--standby" if standby else "--no-standby"]
    ckpt = os.path.join(work, "checkpoint")
    kill_times = drive(cmd, env, ckpt, 0 if mode == "query" else kills, rng,
                       os.path.join(tmp, f"demo-{mode}.log"), standby)
    report = check_delta_table(os.path.join(work, "events"), events_n)
    return restarts(EventLog(ckpt).read(), kill_times), memory(ckpt), "ok" if report.ok else str(report)


def run_kafka_pg(tmp: str, mode: str, kills: int, rng: random.Random, records: int, broker, pg) -> tuple[list[Restart], dict, str]:
    import psycopg
    from confluent_kafka import Producer

    from kafka_broker import create_topic

    standby = mode == "standby"
    topic_env = {"BENCH_BOOTSTRAP": broker.bootstrap, "BENCH_DSN": pg.dsn, "BENCH_PER_BATCH": "5000",
                 "BENCH_CKPT": os.path.join(tmp, f"kpg-{mode}", "ckpt"),
                 **faults(mode, kills, os.path.join(tmp, f"kpg-{mode}"))}
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS recovery")
    try:
        create_topic(broker.bootstrap, "recovery", 2)
        p = Producer({"bootstrap.servers": broker.bootstrap, "linger.ms": 20})
        for i in range(records):
            p.produce("recovery", b"x", str(i).encode(), partition=i % 2)
            if i % 10_000 == 0:
                p.poll(0)
        p.flush(60)
        for part in range(2):  # a sentinel batch per partition: tansu reports a partition's end as
            p.produce("recovery", b"x", b"-1", partition=part)  # its last batch's first offset + 1
            p.flush(30)
    except Exception:  # noqa: BLE001 - the topic exists from the other mode: same records
        pass
    job = os.path.join(tmp, "kafka_pg_job.py")
    with open(job, "w") as f:
        f.write(textwrap.dedent(KAFKA_PG_JOB))
    cmd = [sys.executable, "-m", "onceflow", "run", job, "--standby" if standby else "--no-standby"]
    kill_times = drive(cmd, {**os.environ, **topic_env}, topic_env["BENCH_CKPT"], 0 if mode == "query" else kills,
                       rng, os.path.join(tmp, f"kpg-{mode}.log"), standby)
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        ids = [r[0] for r in conn.execute("SELECT id FROM recovery")]
        dangling = conn.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone()[0]
    report = check_ids(ids, records)
    verdict = "ok" if report.ok and not dangling else f"{report}, {dangling} prepared left"
    return restarts(EventLog(topic_env["BENCH_CKPT"]).read(), kill_times), memory(topic_env["BENCH_CKPT"]), verdict


def run_state(tmp: str, mode: str, kills: int, rng: random.Random, keys: int, per_batch: int) -> tuple[list[Restart], dict, str]:
    """``groupBy(key).count()`` over ``keys`` keys on RocksDB: the state holds every key before
    the first kill, and the stream lasts long enough for ``kills`` steady-state kills."""
    from deltalake import DeltaTable

    standby = mode == "standby"
    work = os.path.join(tmp, f"state-{keys}-{mode}")
    events_n = max(keys, per_batch) + per_batch * (10 + 35 * kills)  # ~35 batches per steady-state kill
    env = {**os.environ, "BENCH_EVENTS": str(events_n), "BENCH_KEYS": str(keys), "BENCH_PER_BATCH": str(per_batch),
           "BENCH_TABLE": os.path.join(work, "counts"), "BENCH_CKPT": os.path.join(work, "ckpt"),
           **faults(mode, kills, work)}
    os.makedirs(work, exist_ok=True)
    job = os.path.join(work, "state_job.py")
    with open(job, "w") as f:
        f.write(textwrap.dedent(STATE_JOB))
    cmd = [sys.executable, "-m", "onceflow", "run", job, "--standby" if standby else "--no-standby"]
    kill_times = drive(cmd, env, env["BENCH_CKPT"], 0 if mode == "query" else kills, rng,
                       os.path.join(tmp, f"state-{keys}-{mode}.log"), standby, after_rows=max(keys, per_batch))
    counts = DeltaTable(env["BENCH_TABLE"]).to_pyarrow_table(columns=["key", "count"]).to_pandas()
    last = counts.groupby("key")["count"].max()
    expected = {k: events_n // keys + (1 if k < events_n % keys else 0) for k in range(keys)}
    wrong = sum(1 for k, n in expected.items() if last.get(k) != n)
    verdict = "ok" if wrong == 0 and len(last) == keys else f"{wrong} of {keys} keys with a wrong last count"
    return restarts(EventLog(env["BENCH_CKPT"]).read(), kill_times), memory(env["BENCH_CKPT"]), verdict


def memory(ckpt: str) -> dict:
    ready = [e for e in EventLog(ckpt).read() if e["event"] == "standby_ready"]
    if not ready:
        return {}
    return {"active_rss_mb": ready[0]["active_rss_mb"], "standby_rss_mb": ready[0]["standby_rss_mb"],
            "warm_s": ready[0]["warm_s"]}


def summarize(name: str, rs: list[Restart], mem: dict, verdict: str) -> dict:
    times = [r.first_commit for r in rs if r.first_commit is not None]
    row = {"run": name, "kills": len(rs), "median_s": statistics.median(times) if times else None,
           "max_s": max(times) if times else None, "verdict": verdict, **mem}
    for phase in Restart.PHASES:
        vals = [getattr(r, phase) for r in rs if getattr(r, phase) is not None]
        row[phase] = statistics.median(vals) if vals else None
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--pipelines", default="demo,kafka-pg")
    ap.add_argument("--modes", default="standby,cold,query")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--events", type=int, default=600_000, help="demo events")
    ap.add_argument("--records", type=int, default=300_000, help="kafka-pg records")
    ap.add_argument("--state-keys", default="1,200000,2000000",
                    help="pipeline state: the state sizes (distinct keys), one run each")
    ap.add_argument("--state-per-batch", type=int, default=100_000, help="pipeline state: events per batch")
    ap.add_argument("--standby-idle", type=float, default=0.0,
                    help="seconds a ready standby waits before the kill (a production standby waits "
                         "minutes to months; Spark stops idle Python workers after 60 s)")
    args = ap.parse_args()
    global STANDBY_IDLE_S
    STANDBY_IDLE_S = args.standby_idle
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    rng = random.Random(args.seed)
    print(f"seed {args.seed}, {args.kills} kills per run", flush=True)
    tmp = tempfile.mkdtemp(prefix="onceflow-bench-recovery-")
    rows = []
    pg = broker = None
    ok = False
    try:
        pipelines = args.pipelines.split(",")
        if "kafka-pg" in pipelines:
            from kafka_broker import KafkaBroker
            from pg_cluster import PgCluster

            pg = PgCluster(max_prepared_transactions=20, fsync=True, name="bench-recovery")
            broker = KafkaBroker().start()
        for pipeline in pipelines:
            for variant in (args.state_keys.split(",") if pipeline == "state" else [""]):
                for mode in args.modes.split(","):
                    name = f"{pipeline}{'-' + variant if variant else ''} {mode}"
                    print(f"{name}:", flush=True)
                    if pipeline == "demo":
                        rs, mem, verdict = run_demo(tmp, mode, args.kills, rng, args.events)
                    elif pipeline == "state":
                        rs, mem, verdict = run_state(tmp, mode, args.kills, rng, int(variant), args.state_per_batch)
                    else:
                        rs, mem, verdict = run_kafka_pg(tmp, mode, args.kills, rng, args.records, broker, pg)
                    for r in rs:
                        print(f"    {r.describe()}", flush=True)
                    rows.append(summarize(name, rs, mem, verdict))
        ok = True
    finally:
        if broker is not None:
            broker.stop()
        if pg is not None:
            pg.destroy()
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp} (its logs) after the failure", flush=True)
    print()
    head = ("run", "kills", "median_s", "max_s", *Restart.PHASES, "standby_rss_mb", "active_rss_mb", "verdict")
    print(" | ".join(head))
    for row in rows:
        print(" | ".join("" if row.get(h) is None else (f"{row[h]:.1f}" if isinstance(row.get(h), float)
                                                      else str(row[h])) for h in head))
    base = {r["run"].split()[0]: r["median_s"] for r in rows if r["run"].endswith("cold")}
    for row in rows:
        cold = base.get(row["run"].split()[0])
        if row["run"].endswith("standby") and cold and row["median_s"]:
            print(f"{row['run']}: median {row['median_s']:.1f}s = {row['median_s'] / cold:.2f}x the cold restart "
                  f"({cold:.1f}s), measured in the same run")
    small: dict[str, tuple[str, float]] = {}  # mode -> the smallest state's run of the state axis
    for row in rows:
        if row["run"].startswith("state-") and row["median_s"]:
            mode = row["run"].split()[1]
            base_run = small.setdefault(mode, (row["run"], row["median_s"]))
            if base_run[0] != row["run"]:
                print(f"{row['run']}: median {row['median_s']:.1f}s = {row['median_s'] / base_run[1]:.2f}x "
                      f"{base_run[0]} ({base_run[1]:.1f}s), measured in the same run")


if __name__ == "__main__":
    main()
