"""Running ``onceflow verify`` from a test: its exit code, its JSON report and its output.

A run that outlives its timeout gets SIGTERM, so verify stops every process it started (a
SIGKILL would leave its drivers and JVMs running beside the next tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_verify(tmp_path: Path, *args: str, env: dict | None = None, timeout: int = 400) -> tuple[int, dict, str]:
    out = tmp_path / "report.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "onceflow", "verify", "--dir", str(tmp_path / "run"), "--json", str(out),
         "--gap", "1-2", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})},
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        output, _ = proc.communicate(timeout=120)
    report = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, report, output
