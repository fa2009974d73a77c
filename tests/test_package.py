"""Packaging (issue 31): the public API as type checkers see it, one version source, py.typed."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import onceflow

SRC = Path(onceflow.__file__).parent

GOOD = """\
from onceflow import CheckpointConfig, DeltaSink, Job, RestartStrategy, exponential_delay


def build() -> Job:
    strategy: RestartStrategy = exponential_delay(initial_backoff="1 s")
    return Job(name="orders", source=lambda spark: spark.readStream.format("rate").load(),
               sink=DeltaSink("/tmp/t"), checkpoint=CheckpointConfig("/tmp/c"),
               restart_strategy=strategy)
"""

BAD = """\
from onceflow import Job, fixed_delay

j: int = Job
s: str = fixed_delay(attempts=2)
"""


def test_mypy_strict_sees_the_public_api_as_classes_and_functions(tmp_path):
    """``from onceflow import Job`` is ``type[Job]`` to mypy, not Any (the lazy ``__getattr__``
    alone made every export Any, and without py.typed mypy refused the package)."""
    (tmp_path / "good.py").write_text(GOOD)
    (tmp_path / "bad.py").write_text(BAD)
    # onceflow's modules are analysed (silently: only the snippets' errors count); third-party
    # packages are not followed (pyspark, pandas, pyarrow: half the time, nothing checked here)
    (tmp_path / "mypy.ini").write_text("[mypy]\nfollow_imports = skip\n\n"
                                       "[mypy-onceflow.*]\nfollow_imports = silent\n")
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--strict", "--no-error-summary",
         "--cache-dir", str(tmp_path / "cache"), "good.py", "bad.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={k: v for k, v in os.environ.items() if k != "MYPYPATH"},
    )
    assert "No module named mypy" not in r.stderr, "mypy is in the test extra: pip install -e '.[test]'"
    lines = r.stdout.splitlines()
    assert not [ln for ln in lines if ln.startswith("good.py")], r.stdout
    assert 'bad.py:3: error: Incompatible types in assignment (expression has type "type[Job]", ' \
           'variable has type "int")' in r.stdout, r.stdout
    assert 'bad.py:4: error: Incompatible types in assignment (expression has type "FixedDelay", ' \
           'variable has type "str")' in r.stdout, r.stdout
    assert len(lines) == 2, r.stdout


def test_exports_type_checking_block_and_all_agree():
    tree = ast.parse((SRC / "__init__.py").read_text())
    checked: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                for alias in imp.names:
                    checked.add(alias.name)
                    assert onceflow._EXPORTS[alias.name] == imp.module, alias.name
    assert checked == set(onceflow._EXPORTS)
    assert set(onceflow.__all__) == checked | {"__version__"}
    for name in onceflow.__all__:  # each one resolves at run time
        assert getattr(onceflow, name) is not None


def test_one_version_source_and_the_package_files():
    assert importlib.metadata.version("onceflow") == onceflow.__version__
    assert (SRC / "py.typed").exists()
    meta = importlib.metadata.metadata("onceflow")
    assert meta["License-Expression"] == "Apache-2.0"
    assert "Typing :: Typed" in meta.get_all("Classifier")
    root = SRC.parent.parent
    assert "Apache License" in (root / "LICENSE").read_text()[:200]
    out = subprocess.run([sys.executable, "-m", "onceflow", "--version"], capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.strip().endswith(onceflow.__version__), out.stdout + out.stderr
    assert textwrap.dedent(f"## [{onceflow.__version__}]") in (root / "CHANGELOG.md").read_text()


def test_test_module_names_are_unique():
    """pytest's default import mode (rootdir-relative, no ``__init__.py``) refuses two test modules
    with one basename ("import file mismatch") depending on collection order, which failed a CI run
    that passed locally: every test module's file name is unique across ``tests/``."""
    import collections
    import pathlib

    tests = pathlib.Path(__file__).resolve().parent
    names = collections.Counter(p.name for p in tests.rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []


# A Python process with only the core install and deltalake (what ./setup.sh installs for the
# README's first command): every other extra's modules are absent, as pip leaves them.
SETUP_SH_ONLY = """
import importlib.abc, importlib.util, json, sys
from onceflow.extras import EXTRAS

absent = {m for extra, mods in EXTRAS.items() for m in mods} - {"deltalake"}
absent |= {"botocore", "aiobotocore"}


class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in absent:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Absent())
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: (
    None if name.split(".")[0] in absent else find_spec(name, package))

import click
import onceflow
from onceflow.cli.main import main

out = {}
for name in onceflow.__all__:
    try:
        getattr(onceflow, name)
        out[name] = "ok"
    except ImportError as e:
        out[name] = str(e)


def helps(group, prefix):
    for name, cmd in sorted(group.commands.items()):
        if cmd.hidden:
            continue
        args = [*prefix, name, "--help"]
        try:
            main.main(args, standalone_mode=False)
            out[" ".join(args)] = "ok"
        except BaseException as e:  # noqa: BLE001
            out[" ".join(args)] = f"{type(e).__name__}: {e}"
        if isinstance(cmd, click.Group):
            helps(cmd, [*prefix, name])


helps(main, [])
sys.stdout.flush()
print(json.dumps(out))
"""


def test_the_cli_and_the_api_load_with_what_setup_sh_installs():
    """``./setup.sh && .venv/bin/onceflow demo`` (the README's first line) installs the core and
    deltalake only. Before, ``onceflow`` itself failed there with an ImportError of psycopg
    (verify's fault list imported it for the CLI's options): every command's help must load,
    and each sink of a missing extra must say which extra to install."""
    r = subprocess.run([sys.executable, "-c", SETUP_SH_ONLY], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    commands = {k: v for k, v in out.items() if k.endswith("--help")}
    assert len(commands) >= 10 and {"demo --help", "verify --help", "run --help"} <= set(commands)
    assert {k: v for k, v in commands.items() if v != "ok"} == {}
    assert out["PostgresSink"] == ("onceflow's PostgreSQL sink (PostgresSink) needs psycopg: "
                                   "pip install 'onceflow[postgres]'")
    assert out["IcebergSink"].endswith("pip install 'onceflow[iceberg]'")
    assert out["DeltaSink"] == out["KafkaSink"] == out["Job"] == "ok"
