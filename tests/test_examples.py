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
from sparksteward.jar import _cache_dir

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

#: a line of our logging (agents, driver, tasks): "<date> <time> <LEVEL> sparksteward.<component>: ..."
_OUR_LINE = re.compile(r"^\S+ \S+ (DEBUG|INFO) sparksteward[.\w]*: ", re.MULTILINE)
#: what pyspark or pip says when their versions do not fit (pandas 3, setuptools' package data)
_WARNINGS = ("does not yet fully support pandas", "Package would be ignored", "UserWarning")


#: the examples ``make test`` runs: started together (each its own Spark application, HOME and state dir),
#: so the three JVMs start side by side instead of one after the other; ``sessions.py`` runs alone in the soak
EXAMPLES = ("quickstart.py", "keyed_state_stream.py", "declared_states.py")


class Example:
    """``examples/<name>`` running in a process of its own, its default state dir (``~/.local/state``) under
    ``home``, its stdout and stderr going to files there: with pipes, an example nobody reads yet would block
    on a full pipe (64 KiB of Spark's progress bars) and the three would run one after the other."""

    def __init__(self, name: str, home: Path) -> None:
        self.name, self.out, self.err = name, home / "stdout.txt", home / "stderr.txt"
        # the shim jar from this run's cache (built once, under its lock): three scalacs at once were most of
        # the module's two minutes; tests/shim/test_build.py builds it the way a first run does
        env = {**os.environ, "HOME": str(home), "SPARK_STEWARD_JAR_CACHE": str(_cache_dir())}
        env.pop("SPARK_STEWARD_LOG_LEVEL", None)
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / name)], cwd=ROOT, env=env,
                                         stdout=out, stderr=err, stdin=subprocess.DEVNULL)

    def finish(self) -> str:
        """Wait for it; check it exits 0 and that stderr has none of our INFO lines and none of the warnings
        above; return its stdout."""
        try:
            self.proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"{self.name} did not finish in 300 s:\n{self.err.read_text()[-4000:]}")
        err = self.err.read_text()
        assert self.proc.returncode == 0, err[-4000:]
        assert not _OUR_LINE.findall(err), err[-4000:]
        assert not [w for w in _WARNINGS if w in err], err[-4000:]
        return self.out.read_text()


@pytest.fixture(scope="module")
def started(request, tmp_path_factory):
    """The examples this session selects, started at once (a soak-only run starts none of the three)."""
    selected = {item.name for item in request.session.items}
    examples = {name: Example(name, tmp_path_factory.mktemp(name.removesuffix(".py"))) for name in EXAMPLES
                if f"test_{name.removesuffix('.py')}_example" in selected}
    yield examples
    for example in examples.values():
        if example.proc.poll() is None:
            example.proc.kill()
            example.proc.wait()


def run_example(name: str, started: dict[str, Example]) -> str:
    """The stdout of ``examples/<name>``, started by the fixture, once it has finished cleanly."""
    return started[name].finish()


@pytest.mark.soak   # the three examples start at once, 85 s: make soak (the suite must stay under 20 min)
def test_quickstart_example(started):
    out = run_example("quickstart.py", started)
    assert re.search(r"driver agent \d+ is running for ", out), out
    assert "payload {'rows': 1000}, scratch gone: True" in out and "quickstart finished" in out


@pytest.mark.soak   # with the other two examples: make soak
def test_keyed_state_stream_example(started):
    out = run_example("keyed_state_stream.py", started)
    assert "after 2 batches, parallelism 4: [('ann', '2'), ('bob', '3'), ('cid', '1'), ('dee', '1')]" in out
    assert "after 3 batches, parallelism 2: [('ann', '3'), ('bob', '3'), ('cid', '1'), ('dee', '1'), ('eve', '2')]" \
        in out
    assert "sink rows: 7" in out and "'action': 'restored'" in out and "'bytes_streamed': 0" in out
    assert "keyed state example finished" in out


@pytest.mark.soak   # with the other two examples: make soak
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


@pytest.mark.soak   # about a minute of its own: make soak runs it, after the suite (which must stay under 20 min)
def test_sessions_example(tmp_path):
    """Issue 38 must-show 2: sessions over out-of-order and late clicks, stopped and restarted at another
    parallelism, equal Spark's session_window over the same clicks (the example checks it, and fails if not)."""
    out = Example("sessions.py", tmp_path).finish()
    assert "first run: 5 batches at parallelism 4, 0 late clicks dropped" in out
    assert "restarted at parallelism 2 (4 before): 4 late clicks dropped" in out
    assert re.search(r"\d+ sessions of 12 users, equal to Spark's session_window over the same clicks; 4 late "
                     r"clicks counted and dropped", out), out


@pytest.mark.soak   # a Spark Connect server of its own: make soak
def test_connect_example(tmp_path):
    """Issue 40 must-show 2: ``make example-connect`` starts a Connect server with the plugin and uses it
    from a client process with no JVM: the broadcast's partial sums add up, run_once runs once, keyed
    state's batches count exactly, and read_state is refused by name."""
    out = Example("connect.py", tmp_path).finish()
    assert "total equal to the client's: True" in out
    assert re.search(r"run_once\('connect-example-[^']+'\): \{'rows': 1000\}, then the stored payload without "
                     r"running again: \{'rows': 1000\}", out)
    assert "batch 1: clicks per user [('user-0', 4), ('user-1', 4), ('user-2', 4)]" in out
    assert "refused on Connect: Steward.read_state is not available on Spark Connect" in out
