"""The examples run as a new user runs them (``make quickstart``, ``make example-state``, ``make example-declared``),
each in its own process; what they print on stderr holds no INFO line of the agents (issue 21: the console
shows WARN and above, INFO goes to the agents' log files) and no warning a new user would stop at."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

#: a line of our logging (agents, driver, tasks): "<date> <time> <LEVEL> sparksteward.<component>: ..."
_OUR_LINE = re.compile(r"^\S+ \S+ (DEBUG|INFO) sparksteward[.\w]*: ", re.MULTILINE)
#: what pyspark or pip says when their versions do not fit (pandas 3, setuptools' package data)
_WARNINGS = ("does not yet fully support pandas", "Package would be ignored", "UserWarning")


def run_example(name: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run ``examples/<name>`` with its default state dir (``~/.local/state``) in a tmp dir; check it exits 0
    and that stderr has none of our INFO lines and none of the warnings above."""
    env = {**os.environ, "HOME": str(tmp_path)}
    env.pop("SPARK_STEWARD_LOG_LEVEL", None)
    done = subprocess.run([sys.executable, str(ROOT / "examples" / name)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert not _OUR_LINE.findall(done.stderr), done.stderr[-4000:]
    assert not [w for w in _WARNINGS if w in done.stderr], done.stderr[-4000:]
    return done


def test_quickstart_example(tmp_path):
    out = run_example("quickstart.py", tmp_path).stdout
    assert re.search(r"driver agent \d+ is running for ", out), out
    assert "payload {'rows': 1000}, scratch gone: True" in out and "quickstart finished" in out


def test_keyed_state_stream_example(tmp_path):
    out = run_example("keyed_state_stream.py", tmp_path).stdout
    assert "after 2 batches, parallelism 4: [('ann', '2'), ('bob', '3'), ('cid', '1'), ('dee', '1')]" in out
    assert "after 3 batches, parallelism 2: [('ann', '3'), ('bob', '3'), ('cid', '1'), ('dee', '1'), ('eve', '2')]" \
        in out
    assert "sink rows: 7" in out and "'action': 'restored'" in out and "'bytes_streamed': 0" in out
    assert "keyed state example finished" in out


def test_declared_states_example(tmp_path):
    out = run_example("declared_states.py", tmp_path).stdout
    assert "batch 0: [('ann', 2, 2, 2), ('bob', 1, 1, 1)]" in out
    assert "batch 1: [('ann', 3, 3, 2), ('cid', 1, 1, 1)]" in out
    assert "batch 2: [('ann', 1, 1, 1)]" in out          # ann's state expired before she came back
    assert "expired entries removed: " in out and "expired entries removed: 0" not in out
    assert "views: [('ann', 1)]" in out and "pages: [('ann', '/d')]" in out
    assert "refused: keyed state 'sessions': state variable 'views' cannot be read as declared" in out
    assert "views now: {'1': 'int32', '2': 'int64'}" in out
    assert "declared states example finished" in out
