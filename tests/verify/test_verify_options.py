"""``onceflow verify``'s options: a wrong one is one clear line before anything starts, and a
seed gives the same fault schedule."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from onceflow.cli.main import main
from onceflow.verify.fault_base import stream_seconds
from onceflow.verify.faults import FAULTS
from onceflow.verify.harness import Harness, Options
from onceflow.verify.spec import VerifySpec


def _spec(tmp_path, **kw) -> VerifySpec:
    return VerifySpec(workdir=str(tmp_path / "w"), name="t", **kw)


def test_a_seed_repeats_the_schedule(tmp_path):
    opts = dict(faults=["driver_kill", "jvm_kill", "worker_kill"], count=7, seed=42)
    one = Harness(_spec(tmp_path), Options(**opts)).schedule()
    two = Harness(_spec(tmp_path), Options(**opts)).schedule()
    other = Harness(_spec(tmp_path), Options(**{**opts, "seed": 43})).schedule()
    assert one == two != other
    assert len(one) == 7 and {k for k, _ in one[:3]} == {"driver_kill", "jvm_kill", "worker_kill"}
    assert all(2.0 <= pause <= 6.0 for _, pause in one)


@pytest.mark.parametrize("args, message", [
    (["--sink", "postgres-two_phase"], "needs --postgres DSN"),
    (["--source", "kafka"], "needs --kafka BOOTSTRAP_SERVERS"),
    (["--faults", "driver_kill,meteor"], "unknown fault(s) meteor"),
    (["--faults", "pg_restart", "--sink", "postgres-idempotent", "--postgres", "postgresql://x@h/db"],
     "needs --pg-stop and --pg-start"),
    (["--faults", "executor_kill"], "--master 'local-cluster[2,1,1024]'"),
    (["--faults", "disk_full"], "needs --checkpoint-fs SIZE"),
    (["--faults", "lost_reply"], "fault lost_reply needs a PostgreSQL sink"),
    (["--faults", "net_partition", "--sink", "kafka", "--kafka", "127.0.0.1:1"],
     "fault net_partition needs a PostgreSQL sink"),
    (["--skew-s", "0"], "'--skew-s': 0.0 is not in the range x>=1"),
    (["--gap", "5-2"], "need 0 <= MIN <= MAX"),
    (["--recovery-timeout", "5"], "'--recovery-timeout': 5.0 is not in the range x>=10"),
])
def test_bad_options_are_one_line_errors(tmp_path, args, message):
    result = CliRunner().invoke(main, ["verify", "--dir", str(tmp_path / "w"), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_refuses_to_wipe_a_directory_it_did_not_create(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("years of work")
    result = CliRunner().invoke(main, ["verify", "--dir", str(tmp_path / "mine")])
    assert result.exit_code == 2 and "is not a verify work directory" in result.output
    assert (tmp_path / "mine" / "thesis.tex").exists()


def test_the_default_stream_has_room_for_every_scheduled_fault(tmp_path):
    """Before: ``rate × (30 + 40 × count)`` whatever the kinds; five clock_skew faults (about 75 s
    of stream each: a successor's start, the held skew, a recovery) on a Kafka source ran out of
    stream after four, an INCONCLUSIVE run from the defaults."""
    assert stream_seconds(FAULTS, ["clock_skew"], 5) == 5 * FAULTS["clock_skew"].stream_s >= 5 * 80
    kinds = ["driver_kill", "clock_skew", "container_restart", "zombie"]
    room = stream_seconds(FAULTS, kinds, 6)
    for seed in range(40):
        plan = Harness(_spec(tmp_path), Options(faults=list(kinds), count=6, seed=seed)).schedule()
        assert sum(FAULTS[k].stream_s for k, _ in plan) <= room
    assert room > 6 * 40  # more than the old sizing gave
    assert stream_seconds(FAULTS, ["driver_kill"], 3) == 120 and stream_seconds(FAULTS, [], 3) == 0
