"""The keyed-state example runs as a new user runs it (``make example-state``), in its own process."""

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
