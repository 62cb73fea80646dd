"""Decision 0026: a Python worker keeps its subtask's DB open between batches, and the executor agent
lets a task go on with it only when that DB is exactly the base of the task's checkpoint. Real driver
and executor agents on sockets; the test plays the worker (it holds the DBs as keyed_tasks does)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.keygroups import key_group_range

from tests.helpers.keyed import read_values
from tests.helpers.state import state_agents

P, M = 1, 8


@pytest.fixture
def rig(tmp_path):
    with state_agents(tmp_path, P, M) as (dconn, econn, subtasks, _):
        yield dconn, econn, subtasks, tmp_path


def task(econn, cid: int, delta: dict[str, int], held: dict[str, RocksDBStateBackend], *, pid: int | None = None,
         dropped=(), unknown=()) -> dict:
    """One task of checkpoint ``cid`` that keeps its DB open: returns the open's reply."""
    opened = econn.request("state.open", name="s", checkpoint_id=cid, subtask=0, held=sorted(held) + list(unknown),
                           dropped=list(dropped), pid=pid or os.getpid())
    for token in opened["stale"]:
        if token in held:
            held.pop(token).close()
    backend = held.pop(opened["kept"]) if opened["kept"] else RocksDBStateBackend(
        opened["workdir"], key_group_range(M, P, 0), M, "string", create=False)
    vs = backend.value("value")
    for k, d in delta.items():
        vs.update(k, (vs.get(k) or 0) + d)
    snap = backend.snapshot(opened["snapshot"], keep_open=True)
    econn.request("state.upload", token=opened["token"], sync_ms=snap.sync_ms, keep=True)
    held[opened["token"]] = backend
    return opened


def commit(dconn, cid: int) -> dict:
    return dconn.request("state.commit", name="s", checkpoint_id=cid, wait=30)["metadata"]


def values(tmp: Path, meta: dict) -> dict:
    return {k: orjson.loads(v) for k, v in read_values(str(tmp / "chk"), "s", "c1", meta)}


def test_the_db_a_worker_kept_goes_on_only_when_it_is_exactly_the_base(rig):
    dconn, econn, subtasks, tmp = rig
    held: dict[str, RocksDBStateBackend] = {}
    try:
        dconn.request("state.begin", name="s", checkpoint_id=0)
        first = task(econn, 0, {"a": 1, "b": 2}, held)
        commit(dconn, 0)
        dconn.request("state.begin", name="s", checkpoint_id=1)
        second = task(econn, 1, {"a": 10}, held)
        assert second["kept"] == first["token"] and second["workdir"] == first["workdir"]
        assert second["restore"]["kept_open"] is True and second["restore"]["base_checkpoint"] == 0
        meta = commit(dconn, 1)
        assert values(tmp, meta) == {"a": 11, "b": 2}

        # checkpoint 2 applied twice (a second action): both attempts start from checkpoint 1. The first
        # goes on with the kept DB; the second cannot (the DB moved past the base) and restores
        dconn.request("state.begin", name="s", checkpoint_id=2)
        a = task(econn, 2, {"b": 100}, held)
        assert a["kept"] == second["token"]
        dconn.request("state.begin", name="s", checkpoint_id=2)   # the driver begins each application
        b = task(econn, 2, {"b": 100}, held)
        assert b["kept"] == "" and a["token"] not in b["stale"]   # newer than the base: it may be the next base
        meta = commit(dconn, 2)
        assert values(tmp, meta) == {"a": 11, "b": 102}

        # checkpoint 3: of the two DBs of checkpoint 2, only the one whose upload completed it (the second
        # application's: the first's ack came after the begin again) goes on; the other is stale, and so is
        # a token this agent never lent
        dconn.request("state.begin", name="s", checkpoint_id=3)
        c = task(econn, 3, {"c": 1}, held, unknown=["not-a-token"])
        assert c["kept"] == b["token"] and sorted(c["stale"]) == sorted([a["token"], "not-a-token"])
        assert not Path(a["workdir"]).exists()   # the stale DB's dir went with the open that named it
        meta = commit(dconn, 3)
        assert values(tmp, meta) == {"a": 11, "b": 102, "c": 1}
    finally:
        for backend in held.values():
            backend.close()


def test_with_keep_open_off_every_batch_restores(rig):
    dconn, econn, subtasks, tmp = rig
    for cid in (0, 1):
        dconn.request("state.begin", name="s", checkpoint_id=cid)
        opened = econn.request("state.open", name="s", checkpoint_id=cid, subtask=0, held=[], pid=os.getpid())
        assert opened["kept"] == ""
        backend = RocksDBStateBackend(opened["workdir"], key_group_range(M, P, 0), M, "string", create=False)
        backend.value("value").update("k", cid)
        snap = backend.snapshot(opened["snapshot"])
        backend.close()
        econn.request("state.upload", token=opened["token"], sync_ms=snap.sync_ms)   # keep: false
        commit(dconn, cid)
    assert not any((subtasks.root / "work").iterdir())   # nothing lent, nothing left


def test_a_dropped_db_and_a_dead_workers_db_leave_no_dir(rig):
    dconn, econn, subtasks, tmp = rig
    held: dict[str, RocksDBStateBackend] = {}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dconn.request("state.begin", name="s", checkpoint_id=0)
        first = task(econn, 0, {"a": 1}, held, pid=child.pid)   # lent to a "worker" that will die
        commit(dconn, 0)
        assert Path(first["workdir"]).is_dir()
        held.pop(first["token"]).close()
        child.kill()
        child.wait()
        subtasks.expire()
        assert not Path(first["workdir"]).exists()   # its worker is gone: its dir went with it

        dconn.request("state.begin", name="s", checkpoint_id=1)
        second = task(econn, 1, {"a": 1}, held)   # restored (the kept DB is gone), then kept
        assert second["kept"] == ""
        commit(dconn, 1)
        held.pop(second["token"]).close()   # the worker closes it on its own (over its limit) ...
        dconn.request("state.begin", name="s", checkpoint_id=2)
        third = task(econn, 2, {"a": 1}, held, dropped=[second["token"]])   # ... and says so at its next open
        assert third["kept"] == "" and not Path(second["workdir"]).exists()
        meta = commit(dconn, 2)
        assert values(tmp, meta) == {"a": 3}
    finally:
        child.kill()
        for backend in held.values():
            backend.close()
