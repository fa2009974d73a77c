"""The long ``onceflow verify`` campaign: every sink, every fault kind, many faults.

One command: ``python benchmarks/verify_long.py [--faults-per-run N] [--runs delta,pg2pc:30,...]
[--seed S] [--out DIR]`` (``name:N`` gives one run its own fault count, ``name:N:kind+kind`` its
own fault kinds instead of every kind the pipeline can take). Two lanes can run side by
side into one ``--out`` (each starts its own PostgreSQL and broker); ``--summary DIR`` prints the
table over every report in DIR.

It starts a throwaway PostgreSQL 15 (so ``pg_restart``/``pg_down`` can stop and start it) and a
tansu broker on S3 storage (a moto server: its log survives ``broker_restart``), then runs
``onceflow verify`` once per pipeline below with every fault that pipeline can take, and prints
one table: faults injected per kind, events, duplicates, missing, corrupted, dangling, recovery
(median/max) and the verdict of each run, plus totals.
Each run's JSON report and chart are kept in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from kafka_broker import KafkaBroker  # noqa: E402
from pg_cluster import OS_USER, PG_BIN, PgCluster  # noqa: E402

#: seconds of stream a fault of these kinds takes beyond --events-per-fault (hold + recovery)
SLOW_S = {"clock_skew": 60, "container_restart": 45, "store_outage": 40, "net_partition": 40, "lost_reply": 25,
          "pg_down": 40, "broker_restart": 40, "disk_full": 40, "concurrent_writer": 25}
OUTAGE_S = 13.0  # pg_down must outlast the verify job's 10 s commit deadline

PROCESS = ["driver_kill", "jvm_kill", "worker_kill", "zombie", "slow_sink", "container_restart", "clock_skew"]
PG_NET = ["net_partition", "lost_reply"]  # through verify's proxy in front of PostgreSQL
RUNS = {  # name: (source, sink, extra faults, master)
    "delta": ("sequence", "delta", ["disk_full"], "local[2]"),
    "delta-cluster": ("sequence", "delta", ["executor_kill"], "local-cluster[2,1,1024]"),
    "delta-jvm": ("sequence", "delta-jvm", ["disk_full"], "local[2]"),
    "delta-jvm-cluster": ("sequence", "delta-jvm", ["executor_kill"], "local-cluster[2,1,1024]"),
    "pg2pc": ("sequence", "postgres-two_phase", ["pg_restart", "pg_down", *PG_NET], "local[2]"),
    "pgidem": ("sequence", "postgres-idempotent", ["pg_restart", "pg_down", *PG_NET], "local[2]"),
    "kafka-pg2pc": ("kafka", "postgres-two_phase", ["pg_restart", "broker_restart", *PG_NET], "local[2]"),
    "kafka-pgidem": ("kafka", "postgres-idempotent", ["pg_restart", "broker_restart", *PG_NET], "local[2]"),
    # new runs go last: a run's seed is --seed plus its index here
    "delta-upsert": ("sequence", "delta-upsert", ["zombie", "concurrent_writer"], "local[2]"),
    "delta-upsert-cluster": ("sequence", "delta-upsert", ["executor_kill"], "local-cluster[2,1,1024]"),
    "iceberg": ("sequence", "iceberg", ["concurrent_writer"], "local[2]"),
    "iceberg-upsert": ("sequence", "iceberg-upsert", ["concurrent_writer"], "local[2]"),
    "iceberg-cluster": ("sequence", "iceberg", ["executor_kill", "concurrent_writer"], "local-cluster[2,1,1024]"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--faults-per-run", type=int, default=40)
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--rate", type=int, default=4000)
    ap.add_argument("--events-per-fault", type=int, default=28_000,
                    help="stream per fault; the sequence clock only runs while a driver runs (about 12k-21k used)")
    ap.add_argument("--recovery-timeout", default="300",
                    help="verify's --recovery-timeout (a cold start on a loaded 2-core machine can take minutes)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--summary", metavar="DIR", help="only print the table of the reports in DIR")
    args = ap.parse_args()
    if args.summary:
        names = sorted(f[:-5] for f in os.listdir(args.summary) if f.endswith(".json"))
        print_table([(n, None, json.load(open(os.path.join(args.summary, f"{n}.json")))) for n in names], args.summary)
        return
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    out = args.out or tempfile.mkdtemp(prefix="onceflow-verify-long-")
    os.makedirs(out, exist_ok=True)
    pg = PgCluster(max_prepared_transactions=40, fsync=True, name="verify-long")
    broker = KafkaBroker(storage="s3").start()
    broker_stop, broker_start = broker.restart_commands
    ctl = f"runuser -u {OS_USER} -- {PG_BIN}/pg_ctl -D {pg.data}"
    rows = []
    try:
        for name, count, kinds in ((r.split(":") + ["", ""])[:3] for r in args.runs.split(",")):
            i = list(RUNS).index(name)
            source, sink, extra, master = RUNS[name]
            faults = kinds.split("+") if kinds else PROCESS + extra
            n = int(count or args.faults_per_run)
            # The sequence clock only runs while a driver runs; a Kafka topic is read at --rate per
            # batch whatever happens, so it keeps verify's default (15 s of --rate per fault).
            # Faults that outlast a lease (a skewed clock held, a restarted container's cold start, a
            # store or network outage) need their own seconds of stream: 2026-11-27's campaign with
            # 40,000 events per fault at 4,000/s injected only 4-10 of 12-15 such faults.
            per_fault = [max(args.events_per_fault, args.rate * SLOW_S.get(k, 0)) for k in faults]
            need = sum(per_fault[i % len(faults)] for i in range(n))
            events = [] if source == "kafka" else ["--events", str(20 * args.rate + need)]
            tag = name + (f"-{kinds.replace('+', '-')}" if kinds else "")
            report = os.path.join(out, f"{tag}.json")
            cmd = [sys.executable, "-m", "onceflow", "verify", "--source", source, "--sink", sink,
                   "--faults", ",".join(faults), "--count", str(n), *events, "--gap", "1-3", "--recovery-timeout", args.recovery_timeout, "--seed", str(args.seed + i),
                   "--rate", str(args.rate), "--master", master, "--dir", os.path.join(out, tag),
                   "--json", report, "--chart", os.path.join(out, f"{tag}.png"), "--outage-s", str(OUTAGE_S),
                   "--postgres", pg.dsn, "--kafka", broker.bootstrap, "--any-time",
                   "--pg-stop", f"{ctl} -m {{mode}} -w -t 60 stop",
                   "--pg-start", f"{ctl} -l {pg.logfile} -w -t 60 start",
                   "--broker-stop", broker_stop, "--broker-start", broker_start]
            if "disk_full" in faults or "store_outage" in faults:
                cmd += ["--checkpoint-fs", "96m"]
            print(f"== {name}: {source} -> {sink} on {master}; faults {', '.join(faults)}", flush=True)
            rc = subprocess.run(cmd).returncode
            r = json.load(open(report)) if os.path.exists(report) else {"verdict": f"no report (exit {rc})"}
            rows.append((tag, rc, r))
            print(f"== {name}: exit {rc}, verdict {r.get('verdict')}", flush=True)
    finally:
        broker.stop()
        pg.destroy()
    print_table(rows, out)


def print_table(rows: list[tuple[str, int | None, dict]], out: str) -> None:
    kinds: Counter = Counter()
    recov: list[float] = []
    print(f"\n{'run':14} {'faults':>6} {'events':>9} {'dup':>5} {'miss':>5} {'corr':>5} {'dangl':>5} "
          f"{'rec med':>8} {'rec max':>8}  verdict")
    for name, rc, r in rows:
        log = r.get("fault_log", [])
        kinds.update(f["kind"] for f in log)
        recov += [f["recovery_s"] for f in log if f.get("recovery_s") is not None]
        print(f"{name:14} {len(log):>6} {r.get('events_generated', 0):>9,} {r.get('duplicates', '-'):>5} "
              f"{r.get('missing', '-'):>5} {r.get('corrupted_payloads', '-'):>5} {len(r.get('dangling', [])):>5} "
              f"{str(r.get('recovery_s_median')):>8} {str(r.get('recovery_s_max')):>8}  {r.get('verdict')}" + ("" if rc is None else f" (exit {rc})"))
        for a in r.get("anomalies", []):
            print(f"    anomaly: {a}")
    print(f"\nfaults by kind: {dict(sorted(kinds.items()))}; total {sum(kinds.values())}")
    if recov:
        print(f"recovery fault -> next commit: median {statistics.median(recov):.1f} s, max {max(recov):.1f} s")
    print(f"reports and charts: {out}")


if __name__ == "__main__":
    main()
