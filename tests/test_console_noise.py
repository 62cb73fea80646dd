"""What the console shows around a streaming query (issue 40): the log4j profile line printed twice and
two ``Failed to cancel job group`` warnings on each ``query.stop()`` were reported from a trial. Both
come from Spark itself: a plain PySpark application prints them just as often (twice and twice in a
plain shell, where log4j is set up once by the launcher and once by the JVM; Spark's stop of a streaming
query cancels its job group after the jobs ended). This checks that the plugin adds none of them and no
warning of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

APP = str(Path(__file__).parent / "helpers" / "console_app.py")
PROFILE = "Using Spark's default log4j profile"
CANCEL = "Failed to cancel job group"


def _run(how: str, tmp: Path) -> str:
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "python"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, APP, how, str(tmp / how)], capture_output=True, text=True, env=env,
                          timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "STOPPED" in out, out[-3000:]
    return out


@pytest.mark.soak   # a minute of its own application: make soak runs it, after the suite (which must stay under 20 min)
def test_the_plugin_adds_no_console_line_of_spark_s_and_no_warning_of_its_own(tmp_path):
    plain, ours = _run("plain", tmp_path), _run("steward", tmp_path)
    assert plain.count(PROFILE) >= 1 and plain.count(CANCEL) >= 1, plain[-3000:]   # Spark's own, without us
    assert ours.count(PROFILE) == plain.count(PROFILE) and ours.count(CANCEL) == plain.count(CANCEL), ours[-3000:]
    assert not [ln for ln in ours.splitlines() if "sparksteward" in ln and ("WARN" in ln or "ERROR" in ln)], ours
