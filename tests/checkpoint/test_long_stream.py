"""A long, low-volume stream stays small (decision 0021): the executor agent folds the WAL by file
count and compacts a small subtask into one SST, so files per subtask, ``_metadata``, the merged
objects in the bucket and the requests of a cold restore stay bounded; a restore reads a merged file
it mostly needs in one GET; and an executor agent SIGKILLed between the fold and the ack leaves a
state that restarts exactly. On moto's S3 server.
"""

from __future__ import annotations

import collections
import signal
import socket
import uuid
from pathlib import Path

import pytest
from sparksteward.checkpoint.filemerging.space import is_merged
from sparksteward.checkpoint.records import FileHandle
from sparksteward.checkpoint.storage import CheckpointStorage, read_ranges
from sparksteward.checkpoint.task.cache import LocalFileCache
from sparksteward.checkpoint.task.transfer import restore_subtask
from sparksteward.errors import StewardError
from sparksteward.state.snapshot import WAL_FLUSH_FILES
from sparksteward.testing.agent import AgentProcess
from sparksteward.wire import new_secret

from tests.helpers import wait_until
from tests.helpers.merging import MergingRig
from tests.helpers.state import split_by_subtask, write_subtask

pytestmark = pytest.mark.usefixtures("guarded_rmtree")  # deletes stay under tmp_path

P = 2
BATCHES = 60


def delta(b: int) -> dict[str, int]:
    """Batch ``b``: a few of 20 keys, each +1..+3."""
    return {f"k{(b * 3 + i) % 20}": 1 + (b + i) % 3 for i in range(4)}


def applied(batches: range) -> dict[str, int]:
    out: dict[str, int] = collections.Counter()
    for b in batches:
        out.update(delta(b))
    return dict(out)


def _seg(offset: int, length: int) -> FileHandle:
    return FileHandle(name=f"f{offset}", path="merged/" + "a" * 32, length=length, checksum="0" * 32, offset=offset)


def test_read_ranges_coalesce_close_or_mostly_needed_segments():
    # adjacent and close segments share one read; a far one alone gets its own
    assert [(a, b, len(s)) for a, b, s in read_ranges([_seg(0, 10), _seg(10, 5), _seg(100, 5), _seg(10 << 20, 7)])] \
        == [(0, 105, 3), (10 << 20, (10 << 20) + 7, 1)]
    # far apart, but together more than half of the span: one read
    big = 1 << 20
    assert len(read_ranges([_seg(0, big), _seg(big + (256 << 10), big)])) == 1
    # far apart and sparse: one read each
    assert len(read_ranges([_seg(0, 1000), _seg(big, 1000)])) == 2
    # never past max_bytes
    assert len(read_ranges([_seg(0, 60), _seg(60, 60)], max_bytes=100)) == 2
    assert read_ranges([]) == []


def test_a_long_low_volume_stream_stays_bounded_and_restores_exactly_in_one_pass(tmp_path, s3):
    """60 batches of a few keys at P=2 on one executor: the fold by count runs (WAL files never pass
    ``wal-flush-files``), files per subtask, ``_metadata`` and merged objects stay bounded, the merged
    objects of early batches are deleted, and a cold restore of the last checkpoint is exact and reads
    each merged file in one GET, with no HEAD."""
    rig = MergingRig(tmp_path, s3.url(f"long-{uuid.uuid4().hex[:8]}"), parallelism=P, executors=1)
    try:
        seen: list[tuple[int, int, int, int]] = []   # batch, most files of a subtask, _metadata bytes, merged objects
        most_wal = 0
        early: set[str] = set()
        for cid in range(BATCHES):
            rig.batch(cid, delta(cid))
            meta = rig.storage.read_metadata(cid)
            stored = {p for p in rig.storage.stored_files() if is_merged(p)}
            if cid == 10:
                early = stored
            most_wal = max(most_wal, *(sum(f.name.endswith(".log") for f in s.files) for s in meta.subtasks))
            seen.append((cid, max(len(s.files) for s in meta.subtasks), len(meta.to_bytes()), len(stored)))
        assert most_wal <= WAL_FLUSH_FILES + 1, f"the WAL was not folded by count: {most_wal} WAL files"
        first, second = seen[: BATCHES // 2], seen[BATCHES // 2:]   # each spans a fold cycle
        for i, what in [(1, "files per subtask"), (2, "_metadata bytes"), (3, "merged objects")]:
            assert max(s[i] for s in second) <= 1.1 * max(s[i] for s in first), f"{what} grew: {seen}"
        assert max(s[1] for s in seen) <= WAL_FLUSH_FILES + 8, seen
        assert max(s[3] for s in seen) <= WAL_FLUSH_FILES + 2, seen
        assert early, "no merged objects at batch 10"
        wait_until(lambda: not early & rig.storage.stored_files(), timeout=10,
                   what="the merged objects of batch 10 to be deleted")

        last = BATCHES - 1
        meta = rig.storage.read_metadata(last)
        fresh = CheckpointStorage.open(rig.checkpoint_dir, rig.name, "c1")
        for handle in meta.subtasks:
            mark = s3.mark()
            stats = restore_subtask(fresh, meta, handle, tmp_path / f"restored-{handle.subtask}",
                                    LocalFileCache(tmp_path / f"cold-cache-{handle.subtask}"))
            reqs = s3.requests_since(mark)
            physical = {f.path for f in handle.files}
            gets = collections.Counter(r.key.rsplit("/", 2)[-2] + "/" + r.key.rsplit("/", 1)[-1]
                                       for r in reqs if r.op == "GetObject")
            assert stats.downloaded_files == len(handle.files) and stats.cached_files == 0
            assert not [r for r in reqs if r.op == "HeadObject"], reqs
            assert set(gets) == physical and max(gets.values()) == 1, (gets, physical)
            assert len(gets) < len(handle.files), "no merged file held more than one segment of the subtask"
        assert rig.values(meta) == applied(range(BATCHES))
    finally:
        rig.close()


# --- a crash between the fold and the ack: real agent processes --------------------------------------
M = 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Agents:
    """A driver agent and one executor agent (real processes) that fold every snapshot with more
    than one WAL file; file merging off, so a snapshot's new files are PUT whole before its ack."""

    def __init__(self, tmp: Path, checkpoint_dir: str, s3) -> None:
        self.tmp, self.checkpoint_dir = tmp, checkpoint_dir
        self.cluster_id = f"long-{uuid.uuid4().hex[:8]}"
        self.secret, self.port = new_secret(), _free_port()
        self.conf = {"spark.steward.state-dir": str(tmp / "state"), "spark.steward.cluster-id": self.cluster_id,
                     "spark.steward.checkpoint.dir": checkpoint_dir,
                     "spark.steward.checkpoint.agent-timeout": "3s",
                     "spark.steward.checkpoint.commit-timeout": "30s",
                     "spark.steward.checkpoint.file-merging.enabled": "false",
                     "spark.steward.checkpoint.orphan-grace": "0s",
                     "spark.steward.state.wal-flush-files": "1",
                     "spark.steward.storage.options": s3.storage_options()}
        self.driver = AgentProcess("driver", self.conf, secret=self.secret, port=self.port)
        assert self.driver.ready, self.driver.first
        self.executor = self.start_executor()
        self.storage = CheckpointStorage.open(checkpoint_dir, "s", self.cluster_id)

    def start_executor(self) -> AgentProcess:
        agent = AgentProcess("executor", self.conf, secret=self.secret, rendezvous_dir=str(self.tmp / "exec"),
                             driver_endpoint=f"127.0.0.1:{self.port}")
        assert agent.ready, agent.first
        return agent

    def request(self, op: str, **fields):
        with self.driver.connect() as conn:
            return conn.request(op, **fields)

    def tasks(self, cid: int, d: dict[str, int]) -> None:
        with self.executor.connect() as conn:
            for i, part in enumerate(split_by_subtask(d, P, M)):
                opened = conn.request("state.open", name="s", checkpoint_id=cid, subtask=i, parallelism=P)
                write_subtask(conn, opened, i, P, M, part)

    def batch(self, cid: int, d: dict[str, int]) -> dict:
        self.request("state.begin", name="s", checkpoint_id=cid)
        self.tasks(cid, d)
        return self.request("state.commit", name="s", checkpoint_id=cid, wait=60)

    def values(self, cid: int) -> dict[str, int]:
        from tests.helpers.keyed import read_values

        meta = self.storage.read_metadata(cid)
        return {k: int(v) for k, v in read_values(self.checkpoint_dir, "s", self.cluster_id, meta.to_json())}

    def close(self) -> None:
        for a in (self.driver, self.executor):
            a.kill()
            if a.proc.stdout:
                a.proc.stdout.close()


@pytest.mark.slow
def test_executor_agent_killed_between_the_fold_and_the_ack_restarts_exactly(tmp_path, s3):
    """Every snapshot after the first folds its WAL (``wal-flush-files=1``). The executor agent is
    SIGKILLed while it PUTs a folded snapshot's new SST (before its ack): the checkpoint aborts, the
    last completed one is whole and exact, and with a new executor agent the batch applied again and
    the next ones commit exactly, with the WAL still folded."""
    from sparksteward.cli import main

    cl = Agents(tmp_path, s3.url(f"long-crash-{uuid.uuid4().hex[:8]}"), s3)
    try:
        cl.request("state.register", name="s", checkpoint_dir=None, parallelism=P, max_parallelism=M,
                   key_type="string", num_retained=1)
        for cid in range(4):
            cl.batch(cid, delta(cid))
        cl.request("state.begin", name="s", checkpoint_id=4)
        with s3.slow("PutObject", 5.0):
            cl.tasks(4, delta(4))
            wait_until(lambda: any(op == "PutObject" and "/shared/" in key for op, key in s3.in_flight()),
                       timeout=20, what="the executor agent to PUT a folded snapshot's file")
            cl.executor.proc.send_signal(signal.SIGKILL)
            cl.executor.proc.wait(10)
        # the killed agent's slowed PUT may still land (its body was sent): let it, so that the gc
        # below sees the orphan rather than racing it (a later gc would collect a late one)
        wait_until(lambda: not s3.in_flight(), timeout=20, what="the killed agent's PUT to end")
        with pytest.raises(StewardError, match="checkpoint 4 of keyed state 's' was aborted"):
            cl.request("state.commit", name="s", checkpoint_id=4, wait=30)
        assert cl.storage.checkpoint_ids() == [3]
        assert cl.values(3) == applied(range(4))
        cl.executor = cl.start_executor()
        for cid in range(4, 8):
            cl.batch(cid, delta(cid))
        assert cl.values(7) == applied(range(8))
        meta = cl.storage.read_metadata(7)
        for s in meta.subtasks:   # folded: one SST, the WAL of at most the last open
            assert sum(f.name.endswith(".log") for f in s.files) <= 2, s.files
            assert sum(f.name.endswith(".sst") for f in s.files) <= 1, s.files
        gc = ["checkpoints", "gc", cl.checkpoint_dir, "s", "--cluster-id", cl.cluster_id, "--min-age", "0s"]
        assert main(gc) == 2   # refused beside the live writer: an unreferenced file may be an upload in flight
    finally:
        cl.close()
    # what the killed agent may have PUT is an orphan no record names: once the writer stopped, gc collects it
    referenced = {f.path for c in cl.storage.checkpoint_ids() for f in cl.storage.read_metadata(c).files()}
    assert main(gc) == 0
    wait_until(lambda: cl.storage.stored_files() == referenced, timeout=20,
               what="only the files of the retained checkpoints to be left")
