"""The examples run as a new user runs them (``make quickstart``, ``make example-state``, ``make example-declared``,
``make example-sessions``),
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


#: the examples this module runs: started together (each its own Spark application, HOME and state dir),
#: so the three JVMs start side by side instead of one after the other
EXAMPLES = ("quickstart.py", "keyed_state_stream.py", "declared_states.py", "sessions.py")


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """Each example's process, started at once with its default state dir (``~/.local/state``) in a tmp dir."""
    procs = {}
    for name in EXAMPLES:
        env = {**os.environ, "HOME": str(tmp_path_factory.mktemp(name.removesuffix(".py")))}
        env.pop("SPARK_STEWARD_LOG_LEVEL", None)
        procs[name] = subprocess.Popen([sys.executable, str(ROOT / "examples" / name)], cwd=ROOT, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def run_example(name: str, started: dict[str, subprocess.Popen[str]]) -> str:
    """Wait for ``examples/<name>``; check it exits 0 and that stderr has none of our INFO lines and none of
    the warnings above; return its stdout."""
    try:
        out, err = started[name].communicate(timeout=300)
    except subprocess.TimeoutExpired:
        started[name].kill()
        out, err = started[name].communicate()
        pytest.fail(f"{name} did not finish in 300 s:\n{err[-4000:]}")
    assert started[name].returncode == 0, err[-4000:]
    assert not _OUR_LINE.findall(err), err[-4000:]
    assert not [w for w in _WARNINGS if w in err], err[-4000:]
    return out


def test_quickstart_example(started):
    out = run_example("quickstart.py", started)
    assert re.search(r"driver agent \d+ is running for ", out), out
    assert "payload {'rows': 1000}, scratch gone: True" in out and "quickstart finished" in out


def test_keyed_state_stream_example(started):
    out = run_example("keyed_state_stream.py", started)
    assert "after 2 batches, parallelism 4: [('ann', '2'), ('bob', '3'), ('cid', '1'), ('dee', '1')]" in out
    assert "after 3 batches, parallelism 2: [('ann', '3'), ('bob', '3'), ('cid', '1'), ('dee', '1'), ('eve', '2')]" \
        in out
    assert "sink rows: 7" in out and "'action': 'restored'" in out and "'bytes_streamed': 0" in out
    assert "keyed state example finished" in out


def test_declared_states_example(started):
    out = run_example("declared_states.py", started)
    assert "batch 0: [('ann', 2, 2, 2), ('bob', 1, 1, 1)]" in out
    assert "batch 1: [('ann', 3, 3, 2), ('cid', 1, 1, 1)]" in out
    assert "batch 2: [('ann', 1, 1, 1)]" in out          # ann's state expired before she came back
    assert "expired entries removed: " in out and "expired entries removed: 0" not in out
    assert "views: [('ann', 1)]" in out and "pages: [('ann', '/d')]" in out
    assert "refused: keyed state 'sessions': state variable 'views' cannot be read as declared" in out
    assert "views now: {'1': 'int32', '2': 'int64'}" in out
    assert "declared states example finished" in out


def test_sessions_example(started):
    """Issue 38 must-show 2: sessions over out-of-order and late clicks, stopped and restarted at another
    parallelism, equal Spark's session_window over the same clicks (the example checks it, and fails if not)."""
    out = run_example("sessions.py", started)
    assert "first run: 5 batches at parallelism 4, 0 late clicks dropped" in out
    assert "restarted at parallelism 2 (4 before): 4 late clicks dropped" in out
    assert re.search(r"\d+ sessions of 12 users, equal to Spark's session_window over the same clicks; 4 late "
                     r"clicks counted and dropped", out), out
