"""Java pre-flight: a missing or too old Java is one clear line, not a JVM launcher trace."""

from __future__ import annotations

import pytest

from onceflow.errors import ConfigError
from onceflow.spark import ensure_java


def fake_java_home(tmp_path, version_line: str):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    java = bin_dir / "java"
    java.write_text(f"#!/bin/sh\necho '{version_line}' >&2\n")
    java.chmod(0o755)
    return tmp_path


def test_missing_java_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="Java 17 or newer is required.*openjdk-17"):
        ensure_java()


@pytest.mark.parametrize("line", ['openjdk version "11.0.22" 2024-01-16', 'java version "1.8.0_392"'])
def test_old_java_is_refused(tmp_path, monkeypatch, line):
    monkeypatch.setenv("JAVA_HOME", str(fake_java_home(tmp_path, line)))
    with pytest.raises(ConfigError, match="needs Java 17 or newer"):
        ensure_java()


def test_java_17_is_accepted(tmp_path, monkeypatch):
    monkeypatch.setenv("JAVA_HOME", str(fake_java_home(tmp_path, 'openjdk version "17.0.15" 2025-04-15')))
    ensure_java()
