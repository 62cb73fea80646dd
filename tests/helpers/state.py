"""Shared fixtures for the keyed-state and checkpoint suites: every storage suite runs on file:// and
on moto's S3 server (one per test module)."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from sparksteward.testing.s3 import local_s3

STORES = ["file", "s3"]


@pytest.fixture(autouse=True)
def guarded_rmtree(tmp_path, monkeypatch):
    """Import into a module to make every ``shutil.rmtree`` outside ``tmp_path`` fail its tests, and to
    put ``tempfile``'s scratch dirs under it: code that deletes can never reach anything else."""
    real = shutil.rmtree

    def rmtree(path, *a, **kw):
        p = Path(path).resolve()
        if p != tmp_path.resolve() and tmp_path.resolve() not in p.parents:
            raise AssertionError(f"rmtree outside tmp_path: {p}")
        return real(path, *a, **kw)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


@pytest.fixture(scope="module")
def _s3_server():
    with local_s3() as s3:
        yield s3


@pytest.fixture(params=STORES)
def store_url(request, tmp_path):
    """A fresh checkpoint-dir URL on each store."""
    if request.param == "file":
        return str(tmp_path / "checkpoints")
    s3 = request.getfixturevalue("_s3_server")
    return s3.url(f"chk-{uuid.uuid4().hex[:8]}")


def checkpoint_backends(storage, backends, checkpoint_id, snap_root, known=frozenset()):
    """Snapshot and upload every subtask's backend; write and return ``chk-<id>/_metadata``.

    What the executor agents (async phase) and the coordinator will do, in one process.
    """
    from sparksteward.checkpoint.records import CheckpointMetadata

    handles, uploaded = [], 0
    for i, b in enumerate(backends):
        snap = b.snapshot(snap_root / f"chk-{checkpoint_id}-{i}", keep_open=True)  # the DBs live on
        r = storage.upload_snapshot(snap.path, i, b.key_groups, known=known)
        handles.append(r.handle)
        uploaded += r.bytes_uploaded
    meta = CheckpointMetadata(storage.state, checkpoint_id, len(backends), backends[0].max_parallelism,
                              tuple(handles), key_type=backends[0].key_type)
    storage.write_metadata(meta)
    return meta, uploaded


def timed(calls: dict) -> dict:
    """Run each call in turn; return how long each took (seconds), by name."""
    import time

    out = {}
    for what, call in calls.items():
        started = time.monotonic()
        call()
        out[what] = time.monotonic() - started
    return out
