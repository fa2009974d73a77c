"""Packaging (issue 31): the public API as type checkers see it, one version source, py.typed."""

from __future__ import annotations

import ast
import importlib.metadata
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
