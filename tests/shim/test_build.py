"""The shim jar: built offline from the installed pyspark, cached, and checked against the goldens."""

from __future__ import annotations

import os
import zipfile

import pytest
from sparksteward.errors import ShimBuildError
from sparksteward.jar import run_shim_tests, shim_jar


@pytest.mark.compat
def test_jar_contains_the_plugin_and_is_cached():
    jar = shim_jar()
    with zipfile.ZipFile(jar) as zf:
        assert "sparksteward/shim/StewardPlugin.class" in zf.namelist()
    mtime = os.stat(jar).st_mtime_ns
    assert shim_jar() == jar and os.stat(jar).st_mtime_ns == mtime, "a second call must not rebuild"


@pytest.mark.compat
def test_scala_golden_protocol_test_passes():
    proc = run_shim_tests()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " 0 failed" in proc.stdout


def test_missing_java_gives_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARK_STEWARD_JAR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "no-jdk"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ShimBuildError, match="Java 17"):
        shim_jar()


def test_the_shim_stays_within_its_budget():
    """docs/decisions/0015: the core (plugin, supervision, listener, messages) and steward:// support."""
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "jvm-shim" / "src" / "main" / "scala" / "sparksteward" / "shim"
    lines = {p.name: len(p.read_text().splitlines()) for p in src.glob("*.scala")}
    core = sum(n for name, n in lines.items() if name != "StewardFileSystem.scala")
    assert set(lines) == {"StewardPlugin.scala", "AgentProcess.scala", "Listener.scala", "Messages.scala",
                          "StewardFileSystem.scala"}, f"a new shim file {sorted(lines)}: give it a budget in 0015"
    assert core <= 560, f"the shim's core has {core} lines, over its budget of 560 (decision 0015)"
    assert lines["StewardFileSystem.scala"] <= 150, "steward:// support is over its budget of 150 (decision 0015)"
    assert sum(lines.values()) <= 700, f"the shim has {sum(lines.values())} lines, over 700 (decision 0015)"
