"""Issue 38 must-show 3 as a test: ``benchmarks/bench_hot_keys.py`` run as a user runs it (its own Spark
application on local-cluster[2,1,1024], P=4, two subtasks each with one hot key whose rows cost 6x the
other subtasks' time), aligned against unaligned with ``form="chunks"``: the unaligned p99 batch time is
at most half the aligned one, with the same final state after the drain. In the soak: a minute and a
half of Spark with two applications' worth of batches."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.bench]

ROOT = Path(__file__).resolve().parents[2]


def test_a_hot_key_no_longer_holds_back_the_unaligned_cut(tmp_path):
    env = {**os.environ, "BENCH_FILES": "6", "BENCH_MODES": "aligned,chunks", "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_hot_keys.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout
    print(out[out.find("hot keys:"):])
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.search(r"p99 chunks / aligned: ([0-9.]+) .*same final state: (True|False)", out)
    assert found is not None, out[-3000:]
    assert float(found.group(1)) <= 0.5 and found.group(2) == "True", found.group(0)
    assert "TARGET PASS" in out
