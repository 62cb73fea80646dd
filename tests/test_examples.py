"""The keyed-state examples run as a new user runs them (``make example-state``, ``make example-declared``), each
in its own process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_keyed_state_stream_example(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path)}  # its default state dir (~/.local/state) is a tmp dir
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "keyed_state_stream.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout
    assert "after 2 batches, parallelism 4: [('ann', '2'), ('bob', '3'), ('cid', '1'), ('dee', '1')]" in out
    assert "after 3 batches, parallelism 2: [('ann', '3'), ('bob', '3'), ('cid', '1'), ('dee', '1'), ('eve', '2')]" \
        in out
    assert "sink rows: 7" in out and "'action': 'restored'" in out and "'bytes_streamed': 0" in out
    assert "keyed state example finished" in out


def test_declared_states_example(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "declared_states.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout
    assert "batch 0: [('ann', 2, 2, 2), ('bob', 1, 1, 1)]" in out
    assert "batch 1: [('ann', 3, 3, 2), ('cid', 1, 1, 1)]" in out
    assert "batch 2: [('ann', 1, 1, 1)]" in out          # ann's state expired before she came back
    assert "expired entries removed: " in out and "expired entries removed: 0" not in out
    assert "views: [('ann', 1)]" in out and "pages: [('ann', '/d')]" in out
    assert "refused: keyed state 'sessions': state variable 'views' cannot be read as declared" in out
    assert "views now: {'1': 'int32', '2': 'int64'}" in out
    assert "declared states example finished" in out
