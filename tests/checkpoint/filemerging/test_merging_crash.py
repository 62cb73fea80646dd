"""FLIP-306 crash tests (issue 9, must-show 3): real agent processes are SIGKILLed while a checkpoint
with merged files is in flight, on file:// and on moto's S3 server.

(a) The driver agent is SIGKILLed after every subtask acked (and, in a variant, after the executor
agents sealed their merged files) but before ``_metadata``. A new driver agent starts on the same
port with the same secret (what the shim does), and the executor agents carry on. Its coordinator
sweeps the orphans at start, every file the retained checkpoints reference is there and reads back,
and the batch applied again commits and equals a clean run.

(b) An executor agent is SIGKILLed while it uploads: a merged physical file (the seal, after every
ack), or a large SST whole (before its subtask's ack). Commit aborts once ``agent-timeout`` passes,
nothing referenced is missing, ``steward checkpoints gc`` leaves exactly the referenced set, and with
a new executor agent the batch applied again commits and equals a clean run. The upload is caught in
the act, not mocked: a staged temp file in the store (file://) or a PUT the S3 server is receiving.
A last test checks the other side: a live agent whose task outlasts ``agent-timeout`` is waited for.

This process plays the shim (the agents' stdin), the Python driver (``state.*`` on the driver agent)
and the Python tasks (``state.open``, RocksDB in the agent's working dir, ``state.upload``).
"""

from __future__ import annotations

import glob
import os
import signal
import socket
import time
import uuid
from pathlib import Path

import pytest
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.errors import StewardError
from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.keygroups import key_group, key_group_range, subtask_for_key_group
from sparksteward.testing.agent import AgentProcess
from sparksteward.wire import new_secret

from tests.helpers import wait_until
from tests.helpers.state import split_by_subtask, write_subtask

pytestmark = pytest.mark.usefixtures("guarded_rmtree")  # deletes stay under tmp_path

P, M = 4, 32
EXECUTORS = 2


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    """(checkpoint dir URL, the S3 server or None)."""
    if request.param == "file":
        return str(tmp_path / "checkpoints"), None
    s3 = request.getfixturevalue("s3")
    return s3.url(f"crash-{uuid.uuid4().hex[:8]}"), s3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keys_of(subtask: int, n: int, prefix: str = "k") -> list[str]:
    """``n`` keys that route to ``subtask``."""
    out, i = [], 0
    while len(out) < n:
        k = f"{prefix}{i}"
        if subtask_for_key_group(M, P, key_group(k, M)) == subtask:
            out.append(k)
        i += 1
    return out


class Cluster:
    """A real driver agent and ``executors`` real executor agents, sharing one secret."""

    def __init__(self, tmp: Path, checkpoint_dir: str, s3, *, max_file_size: str = "64k",
                 agent_timeout: str = "30s", commit_timeout: str = "60s", executors: int = EXECUTORS) -> None:
        self.tmp, self.checkpoint_dir = tmp, checkpoint_dir
        self.cluster_id = f"crash-{uuid.uuid4().hex[:8]}"
        self.secret = new_secret()
        self.port = _free_port()
        self.conf = {"spark.steward.state-dir": str(tmp / "state"),
                     "spark.steward.cluster-id": self.cluster_id,
                     "spark.steward.checkpoint.dir": checkpoint_dir,
                     "spark.steward.checkpoint.agent-timeout": agent_timeout,
                     "spark.steward.checkpoint.commit-timeout": commit_timeout,
                     "spark.steward.checkpoint.upload-threads": "2",
                     "spark.steward.checkpoint.file-merging.enabled": "true",
                     "spark.steward.checkpoint.file-merging.max-file-size": max_file_size,
                     # a restarted driver agent sweeps the orphans of the killed one at once
                     "spark.steward.checkpoint.orphan-grace": "0s"}
        if s3 is not None:  # the agents are told the endpoint explicitly, as Spark's would be
            self.conf["spark.steward.storage.options"] = s3.storage_options()
        self.driver: AgentProcess | None = None
        self.start_driver()
        self.execs: list[AgentProcess | None] = [None] * executors
        for e in range(executors):
            self.start_executor(e)
        self.storage = CheckpointStorage.open(checkpoint_dir, "s", self.cluster_id)

    # --- processes -----------------------------------------------------------------------------
    def start_driver(self) -> None:
        """A driver agent on the fixed port (the shim restarts a dead agent with the same hello)."""
        self.driver = AgentProcess("driver", self.conf, secret=self.secret, port=self.port)
        assert self.driver.ready, self.driver.first

    def start_executor(self, e: int) -> None:
        self.execs[e] = AgentProcess("executor", self.conf, secret=self.secret,
                                     rendezvous_dir=str(self.tmp / f"exec{e}"),
                                     driver_endpoint=f"127.0.0.1:{self.port}")
        assert self.execs[e].ready, self.execs[e].first

    def staged(self, e: int) -> list[str]:
        """Merged physical files executor ``e``'s agents stage locally (not sealed or discarded yet)."""
        return glob.glob(str(self.tmp / f"exec{e}" / ".sparksteward" / "state-*" / "merging" / "*"))

    def close(self) -> None:
        for a in [self.driver, *self.execs]:
            if a is not None:
                a.kill()
                if a.proc.stdout:
                    a.proc.stdout.close()

    # --- the Python driver ------------------------------------------------------------------------
    def request(self, op: str, **fields):
        with self.driver.connect() as conn:
            return conn.request(op, **fields)

    def register(self) -> dict:
        return self.request("state.register", name="s", checkpoint_dir=None, parallelism=P, max_parallelism=M,
                            key_type="string", num_retained=1)

    def all_acked(self, cid: int, wait: float = 0) -> bool:
        """Every subtask of ``cid`` acked: the driver tells holders of merged files to seal. With
        ``wait``, a long poll like the executor agents' that returns the moment the last ack lands."""
        reply = self.request("state.merge_poll", agent="test-probe", wait=wait,
                             pools=[{"name": "s", "checkpoint_id": cid}])
        return reply["actions"][0]["action"] == "seal"

    # --- the Python tasks -------------------------------------------------------------------------
    def task(self, cid: int, subtask: int, delta: dict[str, int], pad: int = 0, executor: int | None = None) -> None:
        """Subtask ``subtask`` of batch ``cid`` on ``executor`` (default ``subtask % executors``):
        adds ``delta`` to the default value state and ``pad`` bytes of incompressible values to
        another state."""
        agent = self.execs[subtask % len(self.execs) if executor is None else executor]
        with agent.connect() as conn:
            opened = conn.request("state.open", name="s", checkpoint_id=cid, subtask=subtask, parallelism=P)

            def padding(backend) -> None:
                chunk = 32 << 10
                keys = keys_of(subtask, pad // chunk + 1, prefix=f"pad{cid}-")
                backend.value("pad").put_many(keys, [os.urandom(chunk // 2).hex() for _ in keys])

            write_subtask(conn, opened, subtask, P, M, delta, padding if pad else None)

    def tasks(self, cid: int, delta: dict[str, int], pads: dict[int, int] | None = None,
              placement: dict[int, int] | None = None) -> None:
        for i, part in enumerate(split_by_subtask(delta, P, M)):
            self.task(cid, i, part, pad=(pads or {}).get(i, 0), executor=(placement or {}).get(i))

    def batch(self, cid: int, delta: dict[str, int], pads: dict[int, int] | None = None) -> dict:
        self.request("state.begin", name="s", checkpoint_id=cid)
        self.tasks(cid, delta, pads)
        return self.request("state.commit", name="s", checkpoint_id=cid, wait=60)

    # --- what is stored ---------------------------------------------------------------------------
    def referenced(self) -> set[str]:
        return {f.path for cid in self.storage.checkpoint_ids() for f in self.storage.read_metadata(cid).files()}

    def stored(self) -> set[str]:
        return self.storage.stored_files() | self.storage.staged_files()

    def values(self, cid: int) -> dict[str, int]:
        from tests.helpers.keyed import read_values

        meta = self.storage.read_metadata(cid)
        return {k: int(v) for k, v in read_values(self.checkpoint_dir, "s", self.cluster_id, meta.to_json())}


def deltas(n: int) -> list[dict[str, int]]:
    return [{f"k{(b * 7 + i) % 90}": b + i + 1 for i in range(40)} for b in range(n)]


def applied(batches: list[dict[str, int]]) -> dict[str, int]:
    """A clean run of ``batches``: the per-key sums."""
    out: dict[str, int] = {}
    for d in batches:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


@pytest.mark.parametrize("kill_at", ["acked", "sealed"])
def test_driver_agent_killed_between_the_acks_and_metadata(tmp_path, store, kill_at):
    """``acked``: killed the moment the last ack lands, when the executor agents start sealing (a
    few MB each, so the seals are usually still running: they finish into a dead driver agent).
    ``sealed``: killed once the merged files are sealed in the store, before ``state.commit``."""
    checkpoint_dir, s3 = store
    batches = deltas(4)
    # batch 2: subtask 0 writes an SST above max-file-size (uploaded whole to shared/ before its
    # ack); subtasks 1 and 3 write ~3 MB each, merged into executor 1's physical file
    pads = {0: 9 << 20, 1: 3 << 20, 3: 3 << 20}
    cl = Cluster(tmp_path, checkpoint_dir, s3, max_file_size="8m")
    try:
        cl.register()
        for cid in range(2):
            cl.batch(cid, batches[cid])
        assert cl.values(1) == applied(batches[:2])

        cl.request("state.begin", name="s", checkpoint_id=2)
        cl.tasks(2, batches[2], pads)
        deadline = time.monotonic() + 30
        while not cl.all_acked(2, wait=5):
            assert time.monotonic() < deadline, "every subtask of checkpoint 2 to ack"
        if kill_at == "sealed":  # the executor agents sealed (uploaded) their merged files; no commit yet
            wait_until(lambda: not any(cl.staged(e) for e in range(EXECUTORS)) and
                       cl.storage.merged_files() - cl.referenced(), timeout=30, what="the seals")
        cl.driver.kill()
        staged_at_kill = sum(len(cl.staged(e)) for e in range(EXECUTORS))
        assert cl.storage.checkpoint_ids() == [1]   # no _metadata of checkpoint 2
        referenced = cl.referenced()
        orphans = cl.stored() - referenced
        assert {p for p in orphans if p.startswith("shared/")}, "the whole SST of checkpoint 2 was uploaded"
        if kill_at == "sealed":
            assert {p for p in orphans if p.startswith("merged/")}, orphans
        print(f"\nkilled the driver agent with {staged_at_kill} merged files staged on the executors; "
              f"orphans in the store: {sorted(orphans)}")

        cl.start_driver()   # same port and secret: the executor agents reach it unchanged
        assert cl.register()["last_completed"] == 1
        # the new coordinator swept every file no retained checkpoint references, at start
        assert cl.stored() == referenced, sorted(cl.stored() ^ referenced)
        assert referenced <= cl.storage.stored_files()
        assert cl.values(1) == applied(batches[:2])
        # the executor agents drop what they staged for checkpoint 2 (the new driver says discard)
        wait_until(lambda: not any(cl.staged(e) for e in range(EXECUTORS)), timeout=15,
                   what="the executor agents to discard checkpoint 2's staged files")

        reply = cl.batch(2, batches[2], pads)   # the batch applied again
        assert reply["checkpoint_id"] == 2 and reply["retained"] == [1, 2]
        assert cl.values(2) == applied(batches[:3])
        cl.batch(3, batches[3])
        assert cl.values(3) == applied(batches)
        assert cl.stored() == cl.referenced()
        assert cl.storage.merged_files() and cl.storage.shared_files()
    finally:
        cl.close()


def _kill_mid_upload(cl: Cluster, e: int, s3, what: str) -> str:
    """SIGKILL executor ``e``'s agent while it uploads: ``merged`` one of its merged physical files
    (the seal), ``shared`` a whole SST (before its ack). Return the path caught in flight."""
    agent = cl.execs[e]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if s3 is not None:
            hits = [k for op, k in s3.in_flight() if op == "PutObject" and f"/s/{what}/" in k]
        else:
            hits = glob.glob(os.path.join(cl.storage.location.path(what), ".*.tmp"))
        if what == "merged":   # executor e's own files (staged locally as merged-<uuid> until sealed)
            mine = {os.path.basename(p).split("-", 1)[1] for p in cl.staged(e)}
            hits = [h for h in hits if os.path.basename(h).lstrip(".").split(".")[0] in mine]
        if hits:
            os.kill(agent.proc.pid, signal.SIGKILL)
            agent.proc.wait(10)
            return hits[0]
        assert agent.proc.poll() is None
        if s3 is not None:
            time.sleep(0.0005)   # moto serves the upload in this process: leave it the GIL
    raise AssertionError(f"executor agent never observed uploading a {what} file")


@pytest.mark.parametrize("during", ["seal", "whole"])
def test_executor_agent_killed_mid_upload(tmp_path, store, during, capsys):
    """``seal``: the agent dies while it uploads a merged physical file (every subtask acked).
    ``whole``: it dies while it uploads a large SST whole, before the subtask's ack; it ran no other
    subtask of the checkpoint, so it holds no merged file the checkpoint needs."""
    from sparksteward.cli import main

    checkpoint_dir, s3 = store
    batches = deltas(3)
    cl = Cluster(tmp_path, checkpoint_dir, s3, max_file_size="32m" if during == "seal" else "64k",
                 agent_timeout="3s", commit_timeout="30s")
    # batch 2 on executor 1 (subtasks 1 and 3): ~12 MB of new state, in one merged physical file
    # (seal) or one whole SST of the last subtask (whole); either upload takes long enough to be
    # caught in the act (a staged temp file in the store, or a PUT the S3 server is receiving)
    pads = {1: 6 << 20, 3: 6 << 20} if during == "seal" else {3: 12 << 20}
    placement = None if during == "seal" else {0: 0, 1: 0, 2: 0, 3: 1}
    try:
        cl.register()
        for cid in range(2):
            cl.batch(cid, batches[cid])
        cl.request("state.begin", name="s", checkpoint_id=2)
        cl.tasks(2, batches[2], pads, placement)
        hit = _kill_mid_upload(cl, 1, s3, "merged" if during == "seal" else "shared")
        started = time.monotonic()
        why = "hold merged checkpoint files it needs" if during == "seal" else \
            r"were uploading its subtasks \[3\] \(not acked\)"
        with pytest.raises(StewardError, match=rf"checkpoint 2 of keyed state 's' was aborted.*executor agents "
                                               rf"\['[^']+'\] {why} and have not answered for 3 s"):
            cl.request("state.commit", name="s", checkpoint_id=2, wait=30)
        took = time.monotonic() - started
        assert took < 10, f"commit took {took:.1f} s to notice the dead executor agent"
        assert cl.storage.checkpoint_ids() == [1]
        referenced = cl.referenced()
        assert referenced <= cl.storage.stored_files()   # nothing referenced is missing
        assert cl.values(1) == applied(batches[:2])
        left = cl.stored() - referenced
        capsys.readouterr()
        gc = ["checkpoints", "gc", checkpoint_dir, "s", "--cluster-id", cl.cluster_id, "--min-age", "0s"]
        assert main(gc) == 2   # the writer is live: its files may be uploads of a batch in flight
        assert "is being written by" in capsys.readouterr().err

        # a new executor agent takes the dead one's place; it sweeps the dead agent's local files
        killed_root = glob.glob(str(tmp_path / "exec1" / ".sparksteward" / "state-*"))
        assert killed_root
        cl.start_executor(1)
        wait_until(lambda: not any(Path(r).exists() for r in killed_root), timeout=10,
                   what="the new executor agent to sweep the killed agent's working root")
        wait_until(lambda: not cl.staged(0), timeout=10, what="executor 0 to discard its staged files")
        cl.batch(2, batches[2], pads)
        assert cl.values(2) == applied(batches)
    finally:
        cl.close()
    # the writer stopped (its lease released): gc collects what the killed upload left
    referenced = cl.referenced()
    left = cl.stored() - referenced
    assert main(gc) == 0
    assert f"deleted {len(left)} orphaned file(s)" in capsys.readouterr().out
    assert cl.stored() == referenced
    with capsys.disabled():
        print(f"\nkilled mid-upload of {hit}; commit aborted after {took:.1f} s; gc collected {sorted(left)}")


def test_a_live_executor_agent_with_a_long_task_is_not_taken_for_dead(tmp_path):
    """The other side of the agent timeout: an agent whose subtask stays open (its task runs) or
    uploads for longer than agent-timeout keeps answering (heartbeats), so commit waits for it."""
    import threading

    batches = deltas(1)
    cl = Cluster(tmp_path, str(tmp_path / "checkpoints"), None, agent_timeout="1s", commit_timeout="30s")
    try:
        cl.register()
        cl.request("state.begin", name="s", checkpoint_id=0)
        parts = split_by_subtask(batches[0], P, M)
        for i in range(P - 1):   # on executor 0; executor 1 runs only the long task (it holds no merged file)
            cl.task(0, i, parts[i], executor=0)
        committed: dict = {}

        def commit() -> None:
            try:
                committed.update(cl.request("state.commit", name="s", checkpoint_id=0, wait=30))
            except StewardError as exc:
                committed["error"] = str(exc)

        committer = threading.Thread(target=commit)
        agent = cl.execs[1]
        with agent.connect() as conn:   # the last task runs 3 agent-timeouts long while commit waits
            opened = conn.request("state.open", name="s", checkpoint_id=0, subtask=P - 1, parallelism=P)
            committer.start()
            time.sleep(3.0)
            backend = RocksDBStateBackend(opened["workdir"], key_group_range(M, P, P - 1), M, "string", create=False)
            try:
                for k, d in parts[P - 1].items():
                    backend.value("value").update(k, d)
                snap = backend.snapshot(opened["snapshot"])
            finally:
                backend.close()
            conn.request("state.upload", token=opened["token"], sync_ms=snap.sync_ms)
        committer.join(30)
        assert committed.get("checkpoint_id") == 0, committed
        assert cl.values(0) == applied(batches)
    finally:
        cl.close()
