"""`onceflow demo` end to end: real supervisor, real SIGKILL of the driver's process group."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_survives_driver_sigkill_exactly_once(tmp_path):
    workdir = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "onceflow", "demo", "--events", "300000", "--rate", "20000",
         "--kills", "1", "--seed", "7", "--any-time", "--dir", str(workdir)],
        capture_output=True, text=True, timeout=400,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "EXACTLY ONCE" in out
    for figure in ("events expected", "events committed", "duplicates", "missing",
                   "records processed incl. replays", "restarts", "recovery time per restart"):
        assert figure in out, f"the demo did not print {figure!r}"
    events = [json.loads(x) for x in (workdir / "checkpoint/_onceflow/events.jsonl").read_text().splitlines()]
    restarts = [e for e in events if e["event"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["cause"] == "killed by SIGKILL"
    assert sum(1 for e in events if e["event"] == "process_start") == 2
    # The history chart of that run: batch durations and rows, the restart marked.
    chart = tmp_path / "history.png"
    r = subprocess.run([sys.executable, "-m", "onceflow", "checkpoints", str(workdir / "checkpoint"),
                        "--chart", str(chart), "--limit", "3"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    batches = int(r.stderr.split("chart ")[1].split(": ")[1].split(" batches")[0])
    assert batches >= 10 and chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_rejects_bad_options(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "onceflow", "demo", "--events", "10"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--events" in proc.stderr and "Traceback" not in proc.stderr
