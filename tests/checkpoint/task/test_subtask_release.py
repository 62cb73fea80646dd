"""What an executor agent does with a subtask a task opened and never uploaded, and with the channel
state it hands a task to replay. No Spark: a real driver-side StateService on an authenticated
socket, and executor agents in process or as a real agent process.

- A replayed channel-state file is the task's own hard link, not a cache path: a small cache bound
  that evicts the entry while the task runs does not take the file away.
- A task killed between open and upload: its working dir is deleted and the agent stops reporting
  the subtask as working once its checkpoint completes or is aborted at the driver, when the same
  subtask of a newer checkpoint opens there, or after ``open_timeout``. A speculative copy of the
  same subtask of the same checkpoint is never released by its twin.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pyarrow as pa
import pytest
from sparksteward.checkpoint.coordination.driver_service import StateService
from sparksteward.checkpoint.filemerging.file_merger import MergingOptions
from sparksteward.checkpoint.task.cache import LocalFileCache
from sparksteward.checkpoint.task.task_state import SubtaskService
from sparksteward.checkpoint.unaligned.channel_state import ChannelStateWriter, read_channel_state
from sparksteward.errors import CheckpointOrderError
from sparksteward.hashing import hash_file
from sparksteward.testing.agent import AgentProcess
from sparksteward.testing.clock import FakeClock
from sparksteward.wire import AgentServer, Connection, new_secret

from tests.helpers import wait_until
from tests.helpers.state import split_by_subtask, write_subtask

pytestmark = pytest.mark.usefixtures("guarded_rmtree")  # deletes stay under tmp_path

P, M = 2, 8


class Driver:
    """The driver agent's StateService on a real socket; records what each heartbeat reports working."""

    def __init__(self, tmp: Path, merging: bool = False) -> None:
        self.secret = new_secret()
        self.server = AgentServer("127.0.0.1", 0, self.secret, {})
        self.states = StateService(str(tmp / "chk"), "c1", commit_timeout=30,
                                   merging=MergingOptions(enabled=merging))
        self.states.register_handlers(self.server)
        poll = self.server.handler("state.merge_poll")
        self.polls: list[set[tuple[str, int, int]]] = []
        self._lock = threading.Lock()

        def recorded(conn, req):
            with self._lock:
                self.polls.append({(w["name"], w["checkpoint_id"], w["subtask"]) for w in req.get("working") or []})
            return poll(conn, req)

        self.server.add_handler("state.merge_poll", recorded)
        self.conn = Connection.connect(self.server.endpoint, self.secret)
        self.conn.request("state.register", name="s", checkpoint_dir=None, parallelism=P, max_parallelism=M,
                          key_type="string", num_retained=1)

    def reported(self) -> list[set[tuple[str, int, int]]]:
        with self._lock:
            return list(self.polls)

    def request(self, op: str, **fields):
        return self.conn.request(op, name="s", **fields)

    def close(self) -> None:
        self.conn.close()
        self.server.close()


@pytest.fixture
def driver(tmp_path):
    d = Driver(tmp_path)
    yield d
    d.close()


def executor(tmp: Path, driver: Driver, tag: str = "", **kw) -> tuple[SubtaskService, AgentServer, Connection]:
    svc = SubtaskService(tmp / f"exec{tag}", driver.server.endpoint, driver.secret, upload_threads=2, **kw)
    server = AgentServer("127.0.0.1", 0, driver.secret, {})
    svc.register_handlers(server)
    return svc, server, Connection.connect(server.endpoint, driver.secret)


def split(delta: dict[str, int]) -> list[dict[str, int]]:
    return split_by_subtask(delta, P, M)


def finish(econn: Connection, opened: dict, subtask: int, delta: dict[str, int],
           defer: pa.RecordBatch | None = None) -> None:
    """The rest of a task after its open: update the state, defer ``defer`` (channel state), snapshot, upload."""
    def channel_state(backend) -> None:
        w = ChannelStateWriter(opened["channel"])
        w.append(defer)
        w.close()

    write_subtask(econn, opened, subtask, P, M, delta, channel_state if defer is not None else None)


def run_task(econn: Connection, cid: int, subtask: int, delta: dict[str, int], **kw) -> None:
    finish(econn, econn.request("state.open", name="s", checkpoint_id=cid, subtask=subtask), subtask, delta, **kw)


# --- replayed channel state ------------------------------------------------------------------------
@pytest.mark.parametrize("merging", [False, True])
def test_replayed_channel_state_survives_cache_eviction(tmp_path, merging):
    """A 1-byte cache bound: the next open on the executor (subtask 1 restoring its files) evicts
    the channel-state entry subtask 0's open fetched for its replay, before the task reads it."""
    d = Driver(tmp_path, merging=merging)
    svc, server, econn = executor(tmp_path, d, cache_max_bytes=1)
    try:
        keys = {f"k{i}": i for i in range(20)}
        deferred = pa.RecordBatch.from_pydict({"k": [f"d{i}" for i in range(500)], "v": list(range(500))})
        d.request("state.begin", checkpoint_id=0)
        for i, part in enumerate(split(keys)):
            run_task(econn, 0, i, part, defer=deferred if i == 0 else None)
        meta = d.request("state.commit", checkpoint_id=0, wait=30)["metadata"]
        assert meta["subtasks"][0]["channel_state"], "subtask 0 deferred input into checkpoint 0"

        d.request("state.begin", checkpoint_id=1)
        first = econn.request("state.open", name="s", checkpoint_id=1, subtask=0)
        assert len(first["replay"]) == 1
        second = econn.request("state.open", name="s", checkpoint_id=1, subtask=1)   # evicts the entry
        checksum = meta["subtasks"][0]["channel_state"][0]["checksum"]
        assert checksum not in svc.cache.entries()
        r = first["replay"][0]
        replayed = pa.Table.from_batches(list(read_channel_state(r["path"], r["name"])))
        assert replayed == pa.Table.from_batches([deferred])
        finish(econn, first, 0, {})
        finish(econn, second, 1, {})
        assert not Path(r["path"]).exists(), "the replay link goes with the upload"
        assert d.request("state.commit", checkpoint_id=1, wait=30)["checkpoint_id"] == 1
    finally:
        econn.close()
        server.close()
        svc.close()
        d.close()


def test_a_pinned_cache_entry_outlives_the_bound(tmp_path):
    """What the replay relies on between its fetch and its link: a pinned entry is never evicted."""
    cache = LocalFileCache(tmp_path / "cache", max_bytes=10)
    srcs = []
    for i in range(3):
        src = tmp_path / f"src{i}"
        src.write_bytes(bytes([i]) * 8)
        srcs.append((src, hash_file(src).hex()))

    def fetch(i: int) -> None:
        src, checksum = srcs[i]
        cache.fetch(checksum, lambda: open(src, "rb"), 8, AssertionError)

    with cache.pinned(srcs[0][1]):
        fetch(0)
        fetch(1)   # 16 bytes > 10: the pinned entry stays, and so does the newest
        assert cache.entries() == sorted([srcs[0][1], srcs[1][1]])
    fetch(2)
    assert cache.entries() == [srcs[2][1]] and cache.size == 8


# --- open subtasks that are never uploaded -----------------------------------------------------------
_KILLED_TASK = """
import os, signal, sys
from sparksteward.wire import Connection
conn = Connection.connect(sys.argv[1], os.environ["STEWARD_TEST_SECRET"])
opened = conn.request("state.open", name="s", checkpoint_id=int(sys.argv[2]), subtask=int(sys.argv[3]))
print(opened["token"], opened["workdir"], flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def killed_task(endpoint: str, secret: str, cid: int, subtask: int) -> tuple[str, Path]:
    """A task process that opens ``subtask`` of ``cid`` and is SIGKILLed before its upload."""
    proc = subprocess.run([sys.executable, "-c", _KILLED_TASK, endpoint, str(cid), str(subtask)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "STEWARD_TEST_SECRET": secret})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    token, workdir = proc.stdout.split()
    return token, Path(workdir)


@pytest.mark.parametrize("end", ["abort", "commit"])
def test_a_killed_task_is_released_when_its_checkpoint_ends(tmp_path, driver, end):
    """A real executor agent; a task process opens subtask 0 of checkpoint 0 and is SIGKILLed.
    ``commit``: the retried task (a second open of the same subtask of the same checkpoint, as a
    speculative copy would be) runs beside the dead one's open and commits; ``abort``: the driver
    aborts. Either way the dead open's working dir goes and the agent stops reporting it."""
    agent = AgentProcess("executor", {"spark.steward.state-dir": str(tmp_path / "state"),
                                      "spark.steward.cluster-id": f"c-{uuid.uuid4().hex[:6]}"},
                         secret=driver.secret, rendezvous_dir=str(tmp_path / "exec"),
                         driver_endpoint=driver.server.endpoint)
    assert agent.ready, agent.first
    try:
        econn = agent.connect()
        driver.request("state.begin", checkpoint_id=0)
        token, workdir = killed_task(agent.endpoint, driver.secret, 0, 0)
        assert workdir.is_dir()
        wait_until(lambda: any(("s", 0, 0) in w for w in driver.reported()), timeout=10,
                   what="the agent to report the open subtask working")
        if end == "commit":
            parts = split({f"k{i}": i for i in range(10)})
            for i in range(P):
                run_task(econn, 0, i, parts[i])   # subtask 0 again beside the dead open: no interference
            assert workdir.is_dir(), "the checkpoint is pending: the dead open is kept until it ends"
            assert driver.request("state.commit", checkpoint_id=0, wait=30)["checkpoint_id"] == 0
        else:
            driver.request("state.abort", checkpoint_id=0)
        wait_until(lambda: not workdir.exists(), timeout=15, what="the agent to delete the dead task's working dir")
        released_at = len(driver.reported())
        # a legit open of the next checkpoint: the heartbeats carry it, and not the released one
        driver.request("state.begin", checkpoint_id=1)
        live = econn.request("state.open", name="s", checkpoint_id=1, subtask=1)
        wait_until(lambda: any(("s", 1, 1) in w for w in driver.reported()[released_at:]), timeout=10,
                   what="a heartbeat with the live subtask")
        assert not any(("s", 0, 0) in w for w in driver.reported()[released_at:])
        with pytest.raises(CheckpointOrderError, match=r"subtask 0 of checkpoint 0 of keyed state 's' was released "
                                                       r"by the executor agent"):
            econn.request("state.upload", token=token)
        assert econn.request("state.release", token=token)["released"] is False
        assert econn.request("state.release", token=live["token"])["released"] is True
        econn.close()
    finally:
        agent.kill()
        if agent.proc.stdout:
            agent.proc.stdout.close()


def test_an_open_of_an_older_checkpoint_is_released_when_a_newer_one_opens(tmp_path, driver):
    """Checkpoint 0 re-run (a second action after its commit) beside pending checkpoint 1: both stay
    pending at the driver, so only the newer open on this agent releases the older one."""
    svc, server, econn = executor(tmp_path, driver)
    try:
        parts = split({f"k{i}": i for i in range(10)})
        driver.request("state.begin", checkpoint_id=0)
        for i in range(P):
            run_task(econn, 0, i, parts[i])
        driver.request("state.commit", checkpoint_id=0, wait=30)
        driver.request("state.begin", checkpoint_id=1)
        old = econn.request("state.open", name="s", checkpoint_id=0, subtask=0)   # re-begins 0 (a re-run)
        other = econn.request("state.open", name="s", checkpoint_id=0, subtask=1)
        assert driver.request("state.info")["pending"] == [0, 1]
        new = econn.request("state.open", name="s", checkpoint_id=1, subtask=0)
        assert not Path(old["workdir"]).exists() and Path(new["workdir"]).is_dir()
        assert Path(other["workdir"]).is_dir(), "another subtask is not touched"
        with pytest.raises(CheckpointOrderError, match=r"subtask 0 of checkpoint 1 opened on this executor"):
            econn.request("state.upload", token=old["token"])
        finish(econn, new, 0, parts[0])
        assert svc.open_subtasks() == 1
    finally:
        econn.close()
        server.close()
        svc.close()


def test_an_open_without_upload_is_released_after_the_open_timeout(tmp_path, driver):
    """The backstop for a checkpoint left pending (a query stopped mid-batch): the clock is moved."""
    clock = FakeClock()
    svc, server, econn = executor(tmp_path, driver, open_timeout=3600.0, clock=clock)
    try:
        driver.request("state.begin", checkpoint_id=0)
        stale = econn.request("state.open", name="s", checkpoint_id=0, subtask=0)
        clock.advance(1800)
        young = econn.request("state.open", name="s", checkpoint_id=0, subtask=1)
        clock.advance(1801)
        wait_until(lambda: not Path(stale["workdir"]).exists(), timeout=10, what="the open timeout")
        assert Path(young["workdir"]).is_dir() and svc.open_subtasks() == 1
        with pytest.raises(CheckpointOrderError, match=r"open for more than 3600 s"):
            econn.request("state.upload", token=stale["token"])
        finish(econn, young, 1, {})
    finally:
        econn.close()
        server.close()
        svc.close()
