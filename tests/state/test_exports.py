"""The public names of the state and checkpoint packages are deliberate (STYLE 12)."""

from __future__ import annotations

import sparksteward.checkpoint as checkpoint
import sparksteward.state as state


def test_state_exports():
    assert sorted(state.__all__) == sorted([
        "BoundListState", "BoundMapState", "BoundValueState", "KeyGroupRange", "KeyState", "KeyType",
        "KeyedStateAccess", "ListState", "LocalSnapshot", "MapState", "RocksDBStateBackend", "ValueState",
        "key_group", "key_group_range", "run_arrow", "run_pandas", "validate_parallelism"])
    assert all(hasattr(state, n) for n in state.__all__)


def test_checkpoint_exports():
    assert sorted(checkpoint.__all__) == sorted([
        "BeginResult", "CheckpointCoordinator", "CheckpointMetadata", "CheckpointStorage", "ClaimMode",
        "Duplicator", "FileHandle", "LocalFileCache", "SnapshotUploader", "SubtaskHandle", "UploadResult",
        "can_fast_duplicate", "open_checkpoint", "open_subtask", "rebuild_subtask", "restore_from",
        "write_savepoint"])
    assert all(hasattr(checkpoint, n) for n in checkpoint.__all__)


def test_no_pyspark_import():
    import subprocess
    import sys

    code = ("import sys, sparksteward.state, sparksteward.checkpoint, sparksteward.checkpoint.cli; "
            "print('pyspark' in sys.modules or 'py4j' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": ":".join(sys.path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
