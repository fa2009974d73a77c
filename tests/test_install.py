"""A new user's install (issue 31): a fresh virtualenv, plain ``pip install '.[kafka,postgres]'``
(no setup.sh, no editable install), then a Kafka -> PostgreSQL job from examples/ against a
real broker and a real PostgreSQL, with the pip that Python ships; the same install with an
upgraded pip; and pip 23.2 resolving the test extra.

What the slim install lacks is one ``error:`` line naming the extra, never a traceback. Times
(2 cores, pip's wheel cache warm): about 20-60 s per install, 40 s for the job, 60 s for the
test extra's resolution; the last two installs run beside the job (threads), so the module
takes about as long as its first test.
"""

from __future__ import annotations

import ensurepip
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import tomllib
import uuid
from pathlib import Path

import psycopg
import pytest

from kafka_broker import KafkaBroker, create_topic, produce
from pg_cluster import PgCluster

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "kafka_to_postgres.py"
pytestmark = pytest.mark.slow


def run(cmd: list, timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)


def source_copy(dest: Path) -> Path:
    """What a source distribution holds: pip builds in the tree, so never in the repository."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    shutil.copytree(REPO / "src", dest / "src", ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, dest / name)
    return dest


def venv_env(venv: Path, **extra: str) -> dict[str, str]:
    """The environment a user of ``venv`` has: none of the suite's Python paths."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    # A fresh install's first driver would build its own JVM class archive in the background
    # (a Spark start and a query: 170 MB and 20-30 s of CPU beside the suite): not what is tested.
    return {**env, "VIRTUAL_ENV": str(venv), "ONCEFLOW_JVM_CACHE": "0", **extra}


def fresh_venv(path: Path, upgrade_pip: bool) -> Path:
    """``python -m venv`` (pip as Python ships it), optionally ``pip install -U pip``."""
    r = run([sys.executable, "-m", "venv", path])
    assert r.returncode == 0, r.stderr
    pip = run([path / "bin" / "python", "-m", "pip", "--version"]).stdout
    assert pip.startswith(f"pip {ensurepip.version()} "), pip  # 23.2.1 with Python 3.11.7
    if upgrade_pip:
        r = run([path / "bin" / "python", "-m", "pip", "install", "-q", "-U", "pip"], env=venv_env(path))
        assert r.returncode == 0, r.stderr[-3000:]
    return path


def pip_install(venv: Path, target: str, *flags: str) -> None:
    r = run([venv / "bin" / "python", "-m", "pip", "install", "-q", *flags, target], env=venv_env(venv))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def installed(venv: Path, *modules: str) -> dict[str, bool]:
    code = f"import importlib.util, json; print(json.dumps({{m: importlib.util.find_spec(m) is not None for m in {list(modules)!r}}}))"
    return json.loads(run([venv / "bin" / "python", "-c", code], env=venv_env(venv)).stdout)


@pytest.fixture(scope="module")
def services():
    """A Kafka-protocol broker and a PostgreSQL with prepared transactions."""
    cluster = PgCluster(max_prepared_transactions=10, name="install")
    try:
        with KafkaBroker() as broker:
            yield broker.bootstrap, cluster
    finally:
        cluster.destroy()


def run_example(venv: Path, services, tmp_path: Path) -> Path:
    """Order events -> examples/kafka_to_postgres.py under ``onceflow run`` -> the last state of
    each order in PostgreSQL; returns the job's checkpoint."""
    bootstrap, pg = services
    topic, table = f"orders-{uuid.uuid4().hex[:8]}", f"orders_{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, topic)
    events = [{"order_id": i % 40, "status": f"s{i // 40}", "amount": float(i)} for i in range(200)]
    produce(bootstrap, topic, [json.dumps(e) for e in events])
    ckpt = tmp_path / "ckpt"
    r = run([venv / "bin" / "onceflow", "run", "--no-standby", EXAMPLE, "--", "--bootstrap", bootstrap,
             "--topic", topic, "--table", table, "--checkpoint", ckpt, "--stop-when-idle", "3"],
            timeout=300, cwd=tmp_path, env=venv_env(venv, ORDERS_DSN=pg.dsn, ONCEFLOW_SPARK_LOG_LEVEL="ERROR"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    with psycopg.connect(pg.dsn) as conn:
        got = conn.execute(f"SELECT order_id, status, amount FROM {table} ORDER BY order_id").fetchall()
    last = {e["order_id"]: (e["order_id"], e["status"], e["amount"]) for e in events}
    assert got == [last[k] for k in sorted(last)]
    return ckpt


def error_line(r: subprocess.CompletedProcess) -> str:
    """The one line a refused command prints (exit 2, no traceback)."""
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout[-2000:] + r.stderr[-3000:]
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    return line


def test_plain_pip_as_python_ships_it_installs_kafka_postgres_and_runs_the_example(
        tmp_path_factory, services, side_installs):
    """pip 23.2 (Python 3.11's), no setup.sh: the install runs the example, leaves the heavy
    extras out, and each missing extra or a missing Java is one line naming the fix."""
    tmp = tmp_path_factory.mktemp("pip-shipped")
    venv = fresh_venv(tmp / "venv", upgrade_pip=False)
    pip_install(venv, f"{source_copy(tmp / 'src')}[kafka,postgres]")
    assert installed(venv, "deltalake", "matplotlib", "psycopg", "confluent_kafka") == {
        "deltalake": False, "matplotlib": False, "psycopg": True, "confluent_kafka": True}
    ckpt = run_example(venv, services, tmp)

    onceflow, env = venv / "bin" / "onceflow", venv_env(venv)
    assert run([onceflow, "checkpoints", ckpt], env=env).returncode == 0
    assert error_line(run([onceflow, "checkpoints", ckpt, "--chart", tmp / "c.png"], env=env)) == \
        "error: onceflow checkpoints --chart needs matplotlib: pip install 'onceflow[charts]'"
    assert error_line(run([onceflow, "demo", "--dir", tmp / "demo"], env=env)) == \
        "error: onceflow demo (it writes a Delta table) needs deltalake: pip install 'onceflow[delta]'"
    (tmp / "delta_job.py").write_text(
        "from onceflow import CheckpointConfig, DeltaSink, Job\n"
        "job = Job(name='d', source=lambda s: s.readStream.format('rate').load(),\n"
        "          sink=DeltaSink('t'), checkpoint=CheckpointConfig('c'))\n")
    assert error_line(run([onceflow, "run", tmp / "delta_job.py"], env=env, cwd=tmp)) == \
        "error: onceflow's Delta sink (DeltaSink) needs deltalake: pip install 'onceflow[delta]'"
    assert error_line(run([onceflow, "verify", "--dir", tmp / "v"], env=env)) == \
        "error: onceflow verify needs deltalake: pip install 'onceflow[verify]'"
    no_java = run([onceflow, "run", "--no-standby", EXAMPLE, "--", "--bootstrap", services[0]],
                  env=venv_env(venv, JAVA_HOME=str(tmp / "no-jdk"), ORDERS_DSN=services[1].dsn), cwd=tmp)
    assert "Java 17 or newer is required" in error_line(no_java)


def upgraded_pip_install(tmp: Path) -> dict[str, bool]:
    venv = fresh_venv(tmp / "venv", upgrade_pip=True)
    # what is checked is what pip resolves and the CLI; compiling pyspark's bytecode (12 s of
    # CPU beside the example's job) is the shipped pip's install's to show
    pip_install(venv, f"{source_copy(tmp / 'src')}[kafka,postgres]", "--no-compile")
    r = run([venv / "bin" / "onceflow", "--version"], env=venv_env(venv))
    assert r.returncode == 0 and r.stdout.startswith("onceflow, version "), r.stderr
    return installed(venv, "onceflow", "pyspark", "psycopg", "confluent_kafka", "deltalake", "matplotlib")


def resolve_test_extra(tmp: Path) -> subprocess.CompletedProcess:
    venv = fresh_venv(tmp / "venv", upgrade_pip=False)
    return run([venv / "bin" / "python", "-m", "pip", "install", "--dry-run", "-q",
                f"{source_copy(tmp / 'src')}[test]"], env=venv_env(venv))


@pytest.fixture(scope="module")
def side_installs(tmp_path_factory):
    """The upgraded-pip install and the test extra's resolution, started at the module's first
    test and run beside it: both wait on the network and pip's cache more than on the CPU."""
    results: dict[str, object] = {}

    def background(name: str, work) -> threading.Thread:
        def target() -> None:
            try:
                results[name] = work(tmp_path_factory.mktemp(name))
            except BaseException as e:  # reported by the test that waits for it
                results[name] = e
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        return thread

    threads = {name: background(name, work) for name, work in
               (("pip-upgraded", upgraded_pip_install), ("resolve-test", resolve_test_extra))}

    def result(name: str):
        threads[name].join(timeout=900)
        value = results.get(name, TimeoutError(name))
        if isinstance(value, BaseException):
            raise value
        return value

    return result


def test_upgraded_pip_installs_kafka_postgres(side_installs):
    """The same install with ``pip install -U pip`` first (what setup.sh does): the CLI runs,
    and the extras asked for are all that come with it."""
    assert side_installs("pip-upgraded") == {"onceflow": True, "pyspark": True, "psycopg": True,
                                             "confluent_kafka": True, "deltalake": False,
                                             "matplotlib": False}


def test_pip_as_python_ships_it_resolves_the_test_extra(side_installs):
    """pip 23.2 found a false fsspec conflict (ResolutionImpossible) in '.[test]' while
    backtracking over s3fs, aiobotocore and boto3 with onceflow's self-referencing extras."""
    r = side_installs("resolve-test")
    assert r.returncode == 0, r.stderr[-3000:]


# distribution -> the module it installs (onceflow.extras names modules)
MODULE = {"deltalake": "deltalake", "matplotlib": "matplotlib", "psycopg": "psycopg",
          "confluent-kafka": "confluent_kafka", "pyiceberg": "pyiceberg", "boto3": "boto3",
          "s3fs": "s3fs", "gcsfs": "gcsfs", "adlfs": "adlfs"}


def test_extras_helper_matches_pyproject_and_the_test_extra_pulls_every_extra():
    from onceflow.extras import EXTRAS

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    name = lambda req: re.match(r"[A-Za-z0-9_.-]+", req).group(0)  # noqa: E731
    for extra, modules in EXTRAS.items():
        assert tuple(MODULE[name(r)] for r in extras[extra]) == modules, extra
    core = {"delta", "charts", "postgres", "kafka", "connect", "s3", "iceberg", "kinesis"}
    assert "verify" in extras and core <= set(extras)
    # spelled out, no "onceflow[...]": pip 23.2 resolved those wrongly
    assert not [r for reqs in extras.values() for r in reqs if name(r) == "onceflow"]
    test = set(extras["test"])
    for extra in core - {"kinesis"}:
        assert set(extras[extra]) <= test, extra
    assert "s3fs[boto3]>=2024.10" in test  # boto3 (kinesis) comes with it, in a range s3fs accepts
