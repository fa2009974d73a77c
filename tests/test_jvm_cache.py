"""The driver JVM's class-data-sharing archive: built once in the background, then used."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from onceflow import jvm_cache


def _env(cache: str, enabled: bool) -> dict:
    return {**os.environ, "ONCEFLOW_JVM_CACHE_DIR": cache, "ONCEFLOW_JVM_CACHE": "1" if enabled else "0"}


@pytest.mark.slow
def test_the_helper_builds_an_archive_that_the_next_driver_jvm_maps(tmp_path):
    # The suite's earlier drivers started the real background build into the default cache;
    # reuse that archive when it is there (a build costs ~40 s), else build one in isolation.
    env = {**os.environ, "ONCEFLOW_JVM_CACHE": "1"}
    path = subprocess.run([sys.executable, "-c", "from onceflow import jvm_cache; print(jvm_cache.archive_path())"],
                          env=env, capture_output=True, text=True, check=True).stdout.strip()
    deadline = time.monotonic() + 240
    while not os.path.exists(path) and os.path.exists(f"{path}.building") and time.monotonic() < deadline:
        time.sleep(1)  # a driver's background helper is writing it
    if not os.path.exists(path):
        cache = str(tmp_path / "cache")
        env = _env(cache, enabled=False)
        path = subprocess.run([sys.executable, "-c", "from onceflow import jvm_cache; print(jvm_cache.archive_path())"],
                              env=env, capture_output=True, text=True, check=True).stdout.strip()
        subprocess.run([sys.executable, "-m", "onceflow.runtime.jvm_archive", path], env=env, timeout=240, check=True,
                       capture_output=True)
        assert os.listdir(cache) == [os.path.basename(path)]  # no partial archive, no lock left
    assert os.path.getsize(path) > 10_000_000
    cache = os.path.dirname(path)

    # -Xshare:on (the user's option wins over onceflow's -Xshare:auto): the JVM refuses to
    # start unless it maps the archive.
    code = ("from onceflow.spark import get_spark\n"
            "s = get_spark('local[1]', 'cds', {'spark.driver.extraJavaOptions': '-Xshare:on'})\n"
            "print(s.range(3).count(), s.sparkContext.getConf().get('spark.driver.extraJavaOptions'))\n")
    out = subprocess.run([sys.executable, "-c", code], env=_env(cache, enabled=True), timeout=240,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("3 ") and f"-XX:SharedArchiveFile={path} " in out.stdout, out.stdout
    assert out.stdout.rstrip().endswith("-Xshare:on"), out.stdout


def test_without_an_archive_one_build_starts_and_the_driver_starts_without_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ONCEFLOW_JVM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ONCEFLOW_JVM_CACHE", "1")
    path = jvm_cache.archive_path()
    os.makedirs(tmp_path, exist_ok=True)
    open(f"{path}.building", "w").close()  # another driver's helper is at work
    assert jvm_cache.java_options() == ""
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(path) + ".building"]

    old = time.time() - 3600  # a helper that died long ago does not block a new build forever
    os.utime(f"{path}.building", (old, old))
    monkeypatch.setenv("ONCEFLOW_JVM_CACHE", "0")
    assert jvm_cache.java_options() == ""  # switched off: no build either
    assert os.path.getmtime(f"{path}.building") == pytest.approx(old)

    open(path, "wb").close()
    monkeypatch.setenv("ONCEFLOW_JVM_CACHE", "1")
    assert jvm_cache.java_options().startswith(f"-XX:SharedArchiveFile={path} ")


def test_a_reinstalled_jar_gets_a_new_archive():
    """The JVM rejects an archive whose jars changed size or mtime; a reinstall of PySpark at
    the same path (same jar names) must not keep pointing at the stale archive (every driver
    would start without one, silently). Old code: the key held the jar names only."""
    import pyspark

    jars = os.path.join(os.path.dirname(pyspark.__file__), "jars")
    jar = os.path.join(jars, sorted(os.listdir(jars))[0])
    st = os.stat(jar)
    before = jvm_cache.archive_path()
    try:
        os.utime(jar, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        assert jvm_cache.archive_path() != before
    finally:
        os.utime(jar, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert jvm_cache.archive_path() == before


def test_prune_keeps_the_current_and_the_last_used_archives_and_drops_dead_partials(tmp_path):
    """Each installation (a venv, a PySpark version) has its own 170 MB archive: without
    pruning a machine that sees many fresh clones fills its disk (seen: 1 GB in a day)."""
    import os
    import time

    from onceflow.jvm_cache import prune

    now = time.time()
    current = tmp_path / "spark-4.3.0-current.jsa"
    current.write_bytes(b"x")
    os.utime(current, (now - 9000, now - 9000))  # the current one stays, however old
    for i in range(4):  # other installations, used 1..4 hours ago
        p = tmp_path / f"spark-4.3.0-other{i}.jsa"
        p.write_bytes(b"x")
        os.utime(p, (now - 3600 * (i + 1), now - 3600 * (i + 1)))
    dead, live = tmp_path / "spark-4.3.0-x.jsa.123.tmp", tmp_path / "spark-4.3.0-y.jsa.456.tmp"
    for p, age in ((dead, 7200), (live, 10)):
        p.write_bytes(b"x")
        os.utime(p, (now - age, now - age))
    removed = prune(str(current), keep=2)
    assert sorted(removed) == sorted(["spark-4.3.0-other2.jsa", "spark-4.3.0-other3.jsa", dead.name])
    assert sorted(os.listdir(tmp_path)) == sorted([current.name, "spark-4.3.0-other0.jsa", "spark-4.3.0-other1.jsa",
                                                   live.name])
