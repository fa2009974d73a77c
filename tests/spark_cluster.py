"""A throwaway Spark standalone cluster for tests: one Master and N Workers, each a separate
process started from the PySpark installation (``bin/spark-class``), on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request

import pyspark

SPARK_HOME = os.path.dirname(pyspark.__file__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StandaloneCluster:
    def __init__(self, workdir: str, workers: int = 2, cores: int = 1, memory: str = "1g"):
        self.workdir, self.port, self.ui = workdir, free_port(), free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        # A lost Worker is noticed after spark.worker.timeout (60 s by default): 10 s here.
        env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_MASTER_OPTS": "-Dspark.worker.timeout=10",
               "SPARK_WORKER_DIR": os.path.join(workdir, "work"), "SPARK_LOG_DIR": workdir}
        self.env = env
        cls = os.path.join(SPARK_HOME, "bin", "spark-class")
        self.master = self._start([cls, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                                   "--port", str(self.port), "--webui-port", str(self.ui)], "master")
        self._wait(lambda s: s.get("status") == "ALIVE", "the Master")
        self.workers = [
            self._start([cls, "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--cores", str(cores),
                         "--memory", memory, "--webui-port", str(free_port()), self.url], f"worker{i}")
            for i in range(workers)
        ]
        self._wait(lambda s: sum(w.get("state") == "ALIVE" for w in s.get("workers", [])) == workers, "the Workers")

    def _start(self, cmd: list[str], name: str) -> subprocess.Popen:
        log = open(os.path.join(self.workdir, f"{name}.log"), "w")  # noqa: SIM115 - closed with the process
        return subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def state(self) -> dict:
        import json

        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui}/json/", timeout=5) as r:
            return json.loads(r.read())

    def _wait(self, ok, what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if ok(self.state()):
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{what} did not come up within {timeout:g}s (logs in {self.workdir})")

    def stop(self) -> None:
        for p in [*self.workers, self.master]:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=30)
