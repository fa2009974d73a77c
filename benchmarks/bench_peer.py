"""Plain ``writeStream`` throughput, each sink in a fresh process: the peer benchmark's form.

One command: ``python benchmarks/bench_peer.py [--seconds 40] [--per-batch 1000000]
[--store local|s3] [--sinks a,b,...] [--repeat R]``.

Every sink runs in a process of its own, started cold as a user's job starts (JVM, Python
workers, imports, the first Delta log reads all count): Spark's ``rate-micro-batch`` source at
``--per-batch`` rows per batch, ``select(value AS id, value % 1000 AS k)``, the default trigger
(the next batch as soon as the last ends), for ``--seconds``. Two figures per sink:

- **window**: rows of the batches that ended within ``--seconds`` of ``start()``, divided by
  ``--seconds`` (what a fresh process delivers, warm-up included: the peer's figure);
- **steady**: rows per second of batch time from the third batch on (warm-up excluded).

Every run's output is read back: the committed rows must be exactly the rows of the completed
batches (one more batch is allowed when the stop came after a commit; ``pyparquet``, which has
no commit, may keep part of the batch the stop interrupted), so a sink that dropped or
duplicated rows cannot win. Sinks (``--sinks``, default by store):

- ``parquet``: Spark's built-in file sink with Spark's defaults, the baseline of the ratios
  (local store only: the PySpark install has no S3 filesystem for the JVM);
- ``delta``: ``DeltaSink(path).write_stream(df, checkpoint)``, what the README gives users who
  keep their own Spark code (the writer a Job runs: Spark's own Parquet writer for a local table,
  the Arrow path on an object store);
- ``onceflow-delta``: ``df.writeStream.format("onceflow-delta")``, always the Arrow path;
- ``discard``: a Python data source whose writer counts its Arrow batches and drops them, the
  ceiling of any sink written in Python (the JVM -> Arrow -> Python worker crossing);
- ``pyparquet``: a Python data source whose writer writes the same Arrow batches as Parquet to
  the same store with pyarrow, one file per task and batch, with no log and no commit: what the
  Arrow path is held against on an object store.

``discard`` and ``pyparquet`` start inside ``onceflow.spark.query_conf``, as ``write_stream``'s
query does, so they receive the same Arrow batches (100,000 rows); the bare format does not.

With ``--store s3`` a moto S3 server is started for the run (``moto_server`` from the
``[dev]`` extra) and every table lives in a bucket there. Ratios are printed against the
baseline of the same run: ``parquet`` locally, ``pyparquet`` on S3.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid

LOCAL_SINKS = "parquet,delta,onceflow-delta,discard"
S3_SINKS = "pyparquet,delta,onceflow-delta,discard"


# ---- the Python data sources of the ceiling and of the object-store baseline ------------------

def _data_sources():
    import pyarrow.parquet as pq
    from pyspark.sql.datasource import DataSource, DataSourceStreamArrowWriter, WriterCommitMessage

    class Done(WriterCommitMessage):
        def __init__(self, rows: int):
            self.rows = rows

    class DiscardWriter(DataSourceStreamArrowWriter):
        def __init__(self, options):
            self.options = options

        def write(self, iterator):
            return Done(sum(b.num_rows for b in iterator))

        def commit(self, messages, batchId):
            pass

        def abort(self, messages, batchId):
            pass

    class ParquetWriter(DiscardWriter):
        def write(self, iterator):
            from pyspark import TaskContext

            from onceflow.storage import url_to_fs

            fs, root = url_to_fs(self.options["path"])
            fs.makedirs(root, exist_ok=True)
            name = f"{root}/part-{TaskContext.get().partitionId()}-{uuid.uuid4().hex}.parquet"
            rows, writer = 0, None
            with fs.open(name, "wb") as f:
                try:
                    for batch in iterator:
                        if writer is None:
                            writer = pq.ParquetWriter(f, batch.schema, compression="snappy")
                        writer.write_batch(batch)
                        rows += batch.num_rows
                finally:
                    if writer is not None:
                        writer.close()
            return Done(rows)

    class Discard(DataSource):
        @classmethod
        def name(cls):
            return "bench-discard"

        def streamWriter(self, schema, overwrite):
            return DiscardWriter(self.options)

    class PyParquet(Discard):
        @classmethod
        def name(cls):
            return "bench-pyparquet"

        def streamWriter(self, schema, overwrite):
            return ParquetWriter(self.options)

    return Discard, PyParquet


# ---- one sink, one fresh process -------------------------------------------------------------

def child(args) -> None:
    started = time.time()
    from onceflow.sinks.delta import DeltaSink
    from onceflow.spark import get_spark, query_conf

    # every batch's progress is kept (Spark keeps the last 100 by default)
    spark = get_spark("local[2]", f"bench-peer-{args.child}",
                      conf={"spark.sql.streaming.numRecentProgressUpdates": "100000"})
    for ds in _data_sources():
        spark.dataSource.register(ds)
    # Spark's own checkpoint stays on the local disk (the JVM has no S3 filesystem here)
    out, ckpt = f"{args.root}/out", args.checkpoint
    df = (spark.readStream.format("rate-micro-batch").option("rowsPerBatch", args.per_batch)
          .option("numPartitions", 2).load().selectExpr("value AS id", "value % 1000 AS k"))
    if args.child == "delta":
        writer = DeltaSink(out).write_stream(df, ckpt)
    else:
        fmt = {"discard": "bench-discard", "pyparquet": "bench-pyparquet"}.get(args.child, args.child)
        writer = df.writeStream.format(fmt).option("path", out).option("checkpointLocation", ckpt)
    t0 = time.time()
    if args.child in ("discard", "pyparquet"):  # the same Arrow batches as write_stream's query gets
        with query_conf(spark, ckpt):
            q = writer.start()
    else:
        q = writer.start()
    deadline = t0 + args.seconds
    while time.time() < deadline and q.exception() is None:
        time.sleep(0.05)
    if q.exception() is not None:
        raise SystemExit(f"{args.child}: {q.exception()}")
    progress = [p for p in q.recentProgress if p.numInputRows]
    try:
        q.stop()
    except Exception as e:  # noqa: BLE001 - a stop in the middle of a batch may raise; the count below decides
        print(f"  ({args.child}: stop raised {type(e).__name__})", file=sys.stderr)
    progress = [p for p in q.recentProgress if p.numInputRows] or progress

    def ended(p) -> float:
        from datetime import datetime

        begin = datetime.fromisoformat(p.timestamp.replace("Z", "+00:00")).timestamp()
        return begin + p.durationMs["triggerExecution"] / 1000

    window = sum(p.numInputRows for p in progress if ended(p) <= deadline) / args.seconds
    steady = [p for p in progress if p.batchId >= 2]
    steady_rate = (sum(p.numInputRows for p in steady) / (sum(p.durationMs["triggerExecution"] for p in steady) / 1000)
                   if steady else 0.0)
    expected = sum(p.numInputRows for p in progress)
    total = written(spark, args.child, out)
    # the stop may come after a batch's commit and before its progress (one batch more); the
    # baseline without a commit may also keep the files of the batch the stop interrupted
    ok = (expected <= total <= expected + args.per_batch if args.child == "pyparquet"
          else total in (expected, expected + args.per_batch))
    if not ok and args.child != "discard":
        raise SystemExit(f"{args.child}: {total:,} rows in the output, expected {expected:,} "
                         f"(the completed batches' rows)")
    first = progress[0].durationMs["triggerExecution"] / 1000 if progress else 0.0
    print(json.dumps({"sink": args.child, "window": window, "steady": steady_rate, "batches": len(progress),
                      "first_batch_s": first, "start_s": t0 - started, "rows": total}))
    spark.stop()


def written(spark, sink: str, out: str) -> int:
    if sink == "discard":
        return -1
    if sink in ("delta", "onceflow-delta"):
        from deltalake import DeltaTable

        from onceflow.storage import delta_target

        target, opts = delta_target(out, None)
        return DeltaTable(target, storage_options=opts).to_pyarrow_dataset().count_rows()
    if sink == "pyparquet":  # file by file: the stop may have cut one short (no commit to hide it)
        import pyarrow.parquet as pq

        from onceflow.storage import url_to_fs

        fs, path = url_to_fs(out)
        total = 0
        for name in fs.ls(path, detail=False):
            try:
                with fs.open(name, "rb") as f:
                    total += pq.ParquetFile(f).metadata.num_rows
            except Exception:  # noqa: BLE001 - a file the stop interrupted
                continue
        return total
    return spark.read.parquet(out).count()


# ---- the run ---------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, dict]:
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    if not os.path.exists(exe):
        raise SystemExit("--store s3 needs moto's server: pip install 'onceflow[dev]' (moto[server])")
    port = _free_port()
    proc = subprocess.Popen([exe, "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    for _ in range(100):
        try:
            client.create_bucket(Bucket="bench")
            break
        except Exception:  # noqa: BLE001 - the server is starting
            time.sleep(0.1)
    else:
        proc.kill()
        raise SystemExit(f"moto_server did not answer on {endpoint}")
    return proc, {"endpoint_url": endpoint, "key": "testing", "secret": "testing", "AWS_REGION": "us-east-1"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--per-batch", type=int, default=1_000_000)
    ap.add_argument("--store", choices=("local", "s3"), default="local")
    ap.add_argument("--sinks", help=f"default: {LOCAL_SINKS} (local), {S3_SINKS} (s3)")
    ap.add_argument("--repeat", type=int, default=1, help="fresh processes per sink; the best counts")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    sinks = (args.sinks or (S3_SINKS if args.store == "s3" else LOCAL_SINKS)).split(",")
    if args.store == "s3" and "parquet" in sinks:
        raise SystemExit("--store s3: Spark's parquet sink cannot reach S3 from this install (no hadoop-aws)")
    tmp = tempfile.mkdtemp(prefix="onceflow-peer-")
    env = dict(os.environ)
    moto = None
    if args.store == "s3":
        moto, opts = start_moto()
        env["ONCEFLOW_STORAGE_OPTIONS"] = json.dumps(opts)
    best: dict[str, dict] = {}
    try:
        for r in range(args.repeat):
            for sink in sinks:
                root = (f"s3://bench/{sink}-{r}-{uuid.uuid4().hex[:6]}" if args.store == "s3"
                        else f"{tmp}/{sink}-{r}")
                cmd = [sys.executable, os.path.abspath(__file__), "--child", sink, "--root", root,
                       "--checkpoint", f"{tmp}/{sink}-{r}-ckpt", "--seconds", str(args.seconds),
                       "--per-batch", str(args.per_batch)]
                res = subprocess.run(cmd, env=env, capture_output=True, text=True)
                lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
                if res.returncode or not lines:
                    print(res.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"{sink}: the run failed (exit {res.returncode})")
                fig = json.loads(lines[-1])
                print(f"  run {r + 1}: {sink:16s} window {fig['window']:12,.0f} rows/s   steady "
                      f"{fig['steady']:12,.0f} rows/s   {fig['batches']} batches, first {fig['first_batch_s']:.1f} s, "
                      f"process to start() {fig['start_s']:.1f} s", flush=True)
                if fig["window"] > best.get(sink, {}).get("window", -1):
                    best[sink] = fig
    finally:
        if moto is not None:
            moto.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    base = "pyparquet" if args.store == "s3" else "parquet"
    base = base if base in best else sinks[0]
    print(f"\nstore={args.store} per_batch={args.per_batch:,} seconds={args.seconds:g} "
          f"(best of {args.repeat}; ratios against {base!r}, same run)")
    for sink, fig in best.items():
        print(f"  {sink:16s} window {fig['window']:12,.0f} rows/s  {fig['window'] / best[base]['window']:5.2f}x   "
              f"steady {fig['steady']:12,.0f} rows/s  {fig['steady'] / best[base]['steady']:5.2f}x")
    if "discard" in best:
        print("  (against the ceiling, 'discard': " + ", ".join(
            f"{s} {f['window'] / best['discard']['window']:.2f}x" for s, f in best.items() if s != "discard") + ")")


if __name__ == "__main__":
    main()
