"""The executor agent's keyed-state working dirs (issue 8): its root is private with an owner file,
deleted on close, and swept by the next agent when its owner was SIGKILLed. No Spark."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from sparksteward.checkpoint.task.task_state import STATE_DIR_PREFIX, SubtaskService

pytestmark = pytest.mark.usefixtures("guarded_rmtree")  # deletes stay under tmp_path


def test_root_is_private_owned_and_deleted_on_close(tmp_path):
    svc = SubtaskService(tmp_path, None, "s" * 32, upload_threads=1)
    assert svc.root.parent == tmp_path and svc.root.name.startswith(f"{STATE_DIR_PREFIX}{os.getpid()}-")
    assert (svc.root / "owner.json").is_file()
    assert oct(svc.root.stat().st_mode & 0o777) == "0o700"
    svc.close()
    svc.close()  # idempotent
    assert not svc.root.exists()


def test_dirs_of_a_sigkilled_agent_are_swept_by_the_next(tmp_path):
    code = ("import os, signal, sys\n"
            "from sparksteward.checkpoint.task.task_state import SubtaskService\n"
            "svc = SubtaskService(sys.argv[1], None, 's' * 32, upload_threads=1)\n"
            "(svc.root / 'work' / 'x').mkdir(parents=True)\n"
            "print(svc.root, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    dead = Path(proc.stdout.strip())
    assert dead.is_dir() and dead.parent == tmp_path
    unowned = tmp_path / f"{STATE_DIR_PREFIX}no-owner"
    unowned.mkdir()
    svc = SubtaskService(tmp_path, None, "s" * 32, upload_threads=1)
    try:
        assert not dead.exists()
        assert unowned.is_dir()  # a dir without an owner file is never deleted
    finally:
        svc.close()
