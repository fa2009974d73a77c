"""The standby's go file: what the supervisor tells a promoted standby about the lease."""

from __future__ import annotations

from onceflow.runtime.standby import promote, takes_over


def test_the_go_file_names_the_epoch_to_take_over_or_none(tmp_path):
    go = str(tmp_path / "go-1")
    promote(go, 7)
    assert takes_over(go) == 7 and takes_over(go) is not True
    promote(go, None)
    assert takes_over(go) is False
    (tmp_path / "go-2").write_text("")  # an empty go file (tests, older supervisors): any holder
    assert takes_over(str(tmp_path / "go-2")) is True
    (tmp_path / "go-3").write_text("at=1.0 takeover=1\n")  # the format before holder=
    assert takes_over(str(tmp_path / "go-3")) is True
