"""docs/configuration.md is what ``onceflow config-reference`` prints, and every
``ONCEFLOW_*`` name in the source is in the registry it is generated from."""

from __future__ import annotations

import pathlib
import re

from onceflow.cli.docgen import render
from onceflow.cli.main import main
from onceflow.settings import SETTINGS

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_page_is_what_the_generator_prints():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == render(main), ("docs/configuration.md is stale: run "
                                  "'onceflow config-reference > docs/configuration.md'")


def test_every_onceflow_variable_in_the_source_is_registered_and_documented():
    names = set()
    for path in (ROOT / "src" / "onceflow").rglob("*.py"):
        names |= set(re.findall(r"\bONCEFLOW_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert len(names) >= 30
    assert sorted(names - set(SETTINGS)) == []
    assert sorted(set(SETTINGS) - names) == []  # nothing registered that the code never names
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert all(f"`{name}`" in page for name in SETTINGS)
