"""A throwaway Spark Connect server for tests, started from the PySpark installation
(``spark-submit --class ...SparkConnectServer``, as ``sbin/start-connect-server.sh`` does)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from spark_cluster import SPARK_HOME, free_port


class ConnectServer:
    """``local[2]`` Spark Connect server on 127.0.0.1; its Python workers run this interpreter
    (and so import the onceflow under test)."""

    def __init__(self, workdir: str, conf: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"sc://127.0.0.1:{self.port}"
        self.log = os.path.join(workdir, "connect-server.log")
        env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable,
               "SPARK_HOME": SPARK_HOME}
        cmd = [os.path.join(SPARK_HOME, "bin", "spark-submit"),
               "--class", "org.apache.spark.sql.connect.service.SparkConnectServer",
               "--master", "local[2]", "--conf", f"spark.connect.grpc.binding.port={self.port}",
               "--conf", "spark.ui.enabled=false", "--conf", "spark.sql.shuffle.partitions=4",
               *[a for k, v in (conf or {}).items() for a in ("--conf", f"{k}={v}")],
               "--name", "onceflow-test-connect", "spark-internal"]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the Connect server exited {self.proc.returncode}; see {self.log}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the Connect server did not listen within 120 s; see {self.log}") from None
                time.sleep(0.5)

    def server_log(self) -> str:
        with open(self.log) as f:
            return f.read()

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
