"""Helpers of the keyed-state and checkpoint suites (their fixtures, ``store_url`` on file:// and moto's
S3 server and ``guarded_rmtree``, are in tests/conftest.py)."""

from __future__ import annotations


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
