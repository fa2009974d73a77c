"""docs/api.md is what ``onceflow api-reference`` prints from the docstrings, and it covers
every name ``onceflow`` exports."""

from __future__ import annotations

import pathlib

import onceflow
from onceflow.cli.apidoc import SECTIONS, render

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_page_is_what_the_generator_prints():
    page = (ROOT / "docs" / "api.md").read_text()
    assert page == render(), "docs/api.md is stale: run 'onceflow api-reference > docs/api.md'"


def test_every_export_is_documented():
    documented = {name for _, module, names in SECTIONS if module == "onceflow" for name in names}
    assert sorted(set(onceflow.__all__) - documented - {"__version__"}) == []
    page = (ROOT / "docs" / "api.md").read_text()
    assert all(f"### `{name}" in page for name in onceflow.__all__ if name != "__version__")
