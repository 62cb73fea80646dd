"""Helpers of the keyed-state and checkpoint suites (their fixtures, ``store_url`` on file:// and moto's
S3 server and ``guarded_rmtree``, are in tests/conftest.py)."""

from __future__ import annotations

import contextlib
from typing import Any


def checkpoint_backends(storage, backends, checkpoint_id, snap_root, known=frozenset()):
    """Snapshot and upload every subtask's backend; write and return ``chk-<id>/_metadata``.

    What the executor agents (async phase) and the coordinator will do, in one process.
    """
    from sparksteward.checkpoint.records import CheckpointMetadata
    from sparksteward.checkpoint.task.transfer import upload_snapshot

    handles, uploaded = [], 0
    for i, b in enumerate(backends):
        snap = b.snapshot(snap_root / f"chk-{checkpoint_id}-{i}", keep_open=True)  # the DBs live on
        r = upload_snapshot(storage, snap.path, i, b.key_groups, known=known)
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


def split_by_subtask(delta: dict[str, int], parallelism: int, max_parallelism: int) -> list[dict[str, int]]:
    """``delta`` split by the subtask its keys are routed to."""
    from sparksteward.state.keygroups import key_group, subtask_for_key_group

    parts: list[dict[str, int]] = [{} for _ in range(parallelism)]
    for k, v in delta.items():
        parts[subtask_for_key_group(max_parallelism, parallelism, key_group(k, max_parallelism))][k] = v
    return parts


def write_subtask(econn, opened: dict, subtask: int, parallelism: int, max_parallelism: int,
                  delta: dict[str, int], extra=None) -> float:
    """What a Python task does after ``state.open`` replied ``opened``: add ``delta`` to the default
    value state, let ``extra(backend)`` write more (other states, channel state), snapshot (the sync
    phase) and ask for the upload. Returns the sync phase's milliseconds."""
    from sparksteward.state.backend import RocksDBStateBackend
    from sparksteward.state.keygroups import key_group_range

    backend = RocksDBStateBackend(opened["workdir"], key_group_range(max_parallelism, parallelism, subtask),
                                  max_parallelism, "string", create=False)
    try:
        vs = backend.value("value")
        for k, d in delta.items():
            vs.update(k, (vs.get(k) or 0) + d)
        if extra is not None:
            extra(backend)
        snap = backend.snapshot(opened["snapshot"])
    finally:
        backend.close()
    econn.request("state.upload", token=opened["token"], sync_ms=snap.sync_ms)
    return snap.sync_ms


@contextlib.contextmanager
def state_agents(tmp_path, parallelism: int, max_parallelism: int, **service: Any):
    """A driver agent's StateService and an executor agent's SubtaskService on real sockets, with state
    ``s`` registered; yields (driver connection, executor connection, subtasks, states). ``service``: the
    StateService's keyword arguments."""
    from sparksteward.checkpoint.coordination.driver_service import StateService
    from sparksteward.checkpoint.task.task_state import SubtaskService
    from sparksteward.wire import AgentServer, Connection, new_secret

    secret = new_secret()
    driver = AgentServer("127.0.0.1", 0, secret, {})
    states = StateService(str(tmp_path / "chk"), "c1", commit_timeout=30, **service)
    states.register_handlers(driver)
    executor = AgentServer("127.0.0.1", 0, secret, {})
    subtasks = SubtaskService(tmp_path / "exec", driver.endpoint, secret, upload_threads=2)
    subtasks.register_handlers(executor)
    dconn = Connection.connect(driver.endpoint, secret)
    econn = Connection.connect(executor.endpoint, secret)
    try:
        dconn.request("state.register", name="s", checkpoint_dir=None, parallelism=parallelism,
                      max_parallelism=max_parallelism, key_type="string", num_retained=1)
        yield dconn, econn, subtasks, states
    finally:
        dconn.close()
        econn.close()
        subtasks.close()
        executor.close()
        driver.close()
        states.close()
