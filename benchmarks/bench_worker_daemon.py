"""A cold driver's first batch and CPU with Spark's Python worker daemon and with onceflow's.

One command: ``python benchmarks/bench_worker_daemon.py [--repeat 3] [--sink delta|postgres]``.

Each run is a fresh driver process (``local[2]``) running a Job: the sequence source, 2
partitions, 6 batches of 20,000 rows, a ``mapInArrow`` step, into the Delta sink (Arrow path)
or PostgreSQL ``two_phase`` (a throwaway cluster). Runs alternate between
``spark.python.daemon.module=pyspark.daemon`` (Spark's: each forked worker imports pyarrow,
pandas and the sink itself) and ``onceflow.runtime.daemon`` (onceflow's default on local
masters: imported once, before the fork). Reported per daemon, median of the runs:

* start -> first commit: what a cold start or a cold restart waits for (the first batch's
  workers start on its critical path);
* the run's wall time and the CPU-s the whole machine spent during it (the driver, its JVM and
  every Python process; the machine should be otherwise idle);

and the ratios onceflow / Spark of the same run. Each run ends with an exactly-once check.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from onceflow.checkpoint.eventlog import EventLog  # noqa: E402
from onceflow.verify.exactly_once import check_delta_table, check_ids  # noqa: E402

DAEMONS = {"spark": "pyspark.daemon", "onceflow": "onceflow.runtime.daemon"}
BATCHES, PER_BATCH = 6, 20_000

JOB = textwrap.dedent(
    """
    import os, sys
    from onceflow import CheckpointConfig, DeltaSink, Job, PostgresSink, fixed_delay

    def step(batches):
        yield from batches

    work = os.environ["WORK"]
    sink = (DeltaSink(work + "/table") if os.environ["SINK"] == "delta"
            else PostgresSink(os.environ["DSN"], "events", mode="two_phase", create_table=True))
    Job(
        name="bench-daemon",
        source=lambda spark: spark.readStream.format("onceflow-sequence")
            .option("total", int(os.environ["TOTAL"])).option("rows_per_second", 10**7)
            .option("max_rows_per_batch", int(os.environ["PER_BATCH"])).option("partitions", 2).load()
            .mapInArrow(step, "id long, key long, event_time timestamp"),
        sink=sink,
        checkpoint=CheckpointConfig(work + "/ckpt", interval=0),
        restart_strategy=fixed_delay(attempts=0, delay=0),
        master="local[2]",
        spark_conf={"spark.python.daemon.module": os.environ["DAEMON"]},
        stop_when_idle=1.0,
    ).run()
    """
)


def _busy() -> float:
    """CPU-s the whole machine has spent so far (all cores, /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # minus idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def run_once(daemon: str, sink: str, dsn: str | None, work: str) -> dict[str, float]:
    os.makedirs(work)
    with open(f"{work}/job.py", "w") as f:
        f.write(JOB)
    env = {**os.environ, "WORK": work, "SINK": sink, "DSN": dsn or "", "DAEMON": daemon,
           "TOTAL": str(BATCHES * PER_BATCH), "PER_BATCH": str(PER_BATCH)}
    cpu, t0, wall0 = _busy(), time.monotonic(), time.time()
    out = subprocess.run([sys.executable, f"{work}/job.py"], env=env, capture_output=True, text=True, timeout=600)
    wall, cpu = time.monotonic() - t0, _busy() - cpu
    if out.returncode != 0:
        raise SystemExit(f"the job failed ({daemon}):\n{out.stderr[-3000:]}")
    commits = [e["ts"] for e in EventLog(f"{work}/ckpt").read() if e["event"] == "sink_commit"]
    return {"first_commit_s": min(commits) - wall0, "wall_s": wall, "cpu_s": cpu}


def check(sink: str, dsn: str | None, work: str, total: int) -> None:
    if sink == "delta":
        report = check_delta_table(f"{work}/table", total)
        ok = report.ok
    else:
        import psycopg

        with psycopg.connect(dsn) as conn:
            ids = [r[0] for r in conn.execute("SELECT id FROM events")]
            conn.execute("DROP TABLE events")
        report = check_ids(ids, total)
        ok = report.ok
    if not ok:
        raise SystemExit(f"exactly-once check failed: {report}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs per daemon (alternating)")
    ap.add_argument("--sink", choices=["delta", "postgres"], default="delta")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="bench-daemon-")
    cluster = None
    dsn = None
    if args.sink == "postgres":
        from pg_cluster import PgCluster

        cluster = PgCluster()
        dsn = cluster.dsn
    results: dict[str, list[dict[str, float]]] = {name: [] for name in DAEMONS}
    try:
        for i in range(args.repeat):
            for name, module in DAEMONS.items():
                work = os.path.join(base, f"{name}-{i}")
                r = run_once(module, args.sink, dsn, work)
                check(args.sink, dsn, work, BATCHES * PER_BATCH)
                results[name].append(r)
                print(f"run {i + 1}/{args.repeat} {name:8s} first commit {r['first_commit_s']:.2f} s, "
                      f"wall {r['wall_s']:.1f} s, CPU {r['cpu_s']:.1f} s", flush=True)
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(base, ignore_errors=True)
    med = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()}
    print(f"\nsink {args.sink}, {args.repeat} runs per daemon, medians:")
    for key, label in (("first_commit_s", "start -> first commit"), ("wall_s", "wall"), ("cpu_s", "CPU-s")):
        spark, ours = med["spark"][key], med["onceflow"][key]
        print(f"  {label:22s} Spark's daemon {spark:6.2f}   onceflow's {ours:6.2f}   ratio {ours / spark:.2f}x")
    print(json.dumps(med))


if __name__ == "__main__":
    main()
