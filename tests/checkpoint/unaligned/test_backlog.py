"""The backlog of unaligned batches (FLIP-76) without Spark: real driver and executor agents over
authenticated sockets, real channel-state files. The backlog shows in state.info and the metrics and
a growing one is warned about; a drain is an aligned checkpoint under the next id, which later
streaming batches skip (after a restart too); a new input schema while rows are deferred is refused
by name."""

from __future__ import annotations

import logging

import pyarrow as pa
import pytest
from sparksteward.checkpoint.coordination.driver_service import StateService
from sparksteward.checkpoint.task.task_state import SubtaskService
from sparksteward.checkpoint.unaligned.backlog import DrainLog, growth
from sparksteward.checkpoint.unaligned.channel_state import ChannelStateWriter
from sparksteward.errors import CorruptRecordError, StateError, StewardError
from sparksteward.keyed_tasks import KG_COL, unaligned_input
from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.keygroups import KeyGroupRange, key_group_range
from sparksteward.wire import AgentServer, Connection, new_secret

pytestmark = pytest.mark.usefixtures("guarded_rmtree")  # deletes stay under tmp_path

P, M = 2, 8
UNALIGNED = {"alignment": "unaligned", "aligned_checkpoint_timeout": 0}


class Rig:
    """A driver agent (StateService) and an executor agent (SubtaskService) on one checkpoint dir."""

    def __init__(self, tmp_path, tag: str) -> None:
        self.secret = new_secret()
        self.driver = AgentServer("127.0.0.1", 0, self.secret, {})
        self.states = StateService(str(tmp_path / "chk"), "c1", commit_timeout=30, lease_timeout=5)
        self.states.register_handlers(self.driver)
        self.executor = AgentServer("127.0.0.1", 0, self.secret, {})
        self.subtasks = SubtaskService(tmp_path / f"exec-{tag}", self.driver.endpoint, self.secret, upload_threads=2)
        self.subtasks.register_handlers(self.executor)
        self.d = Connection.connect(self.driver.endpoint, self.secret)
        self.e = Connection.connect(self.executor.endpoint, self.secret)
        self.d.request("state.register", name="s", checkpoint_dir=None, parallelism=P, max_parallelism=M,
                       key_type="string", num_retained=1, alignment=UNALIGNED)

    def run(self, cid: int, deferred: list[int]) -> list[dict]:
        """Every subtask of ``cid`` opens, defers ``deferred[i]`` rows into its channel state, uploads."""
        opens = []
        for i, n in enumerate(deferred):
            opened = self.e.request("state.open", name="s", checkpoint_id=cid, subtask=i, parallelism=P)
            opens.append(opened)
            backend = RocksDBStateBackend(opened["workdir"], key_group_range(M, P, i), M, "string", create=False)
            snap = backend.snapshot(opened["snapshot"])
            backend.close()
            if n:
                w = ChannelStateWriter(opened["channel"])
                w.append(pa.RecordBatch.from_pydict({"k": [f"k{j}" for j in range(n)], "v": list(range(n))}))
                w.close()
            self.e.request("state.upload", token=opened["token"], sync_ms=snap.sync_ms,
                           counters={"rows_deferred": n, "unaligned": int(bool(n))})
        self.d.request("state.commit", name="s", checkpoint_id=cid, wait=30)
        return opens

    def close(self) -> None:
        for x in (self.d, self.e, self.subtasks, self.executor, self.driver, self.states):
            x.close()   # each is idempotent


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path, "a")
    yield r
    r.close()


def test_the_backlog_shows_a_growing_one_is_warned_and_a_drain_is_aligned_under_an_id_batches_skip(
        rig, tmp_path, caplog):
    d = rig.d
    for batch, n in enumerate([10, 20, 30, 40]):   # subtask 0 defers more in every batch
        begun = d.request("state.begin", name="s", batch_id=batch)
        assert begun["checkpoint_id"] == batch and begun["unaligned"] and not begun["backlog_warning"]
        rig.run(batch, [n, 0])
    backlog = d.request("state.info", name="s")["backlog"]
    assert backlog["checkpoint_id"] == 3 and backlog["rows"] == 40 and backlog["bytes"] > 0
    assert backlog["subtasks"] == [0] and backlog["growth"] == 3
    metrics = rig.states.metrics()
    assert metrics["state.s.unaligned.backlog_rows"] == 40 and metrics["state.s.unaligned.backlog_growth"] == 3
    assert metrics["state.s.unaligned.backlog_bytes"] == backlog["bytes"]
    with caplog.at_level(logging.WARNING, logger="sparksteward.checkpoint.coordination.driver_service"):
        warning = d.request("state.begin", name="s", batch_id=4)["backlog_warning"]
    assert "grew for 3 checkpoints in a row, to 40 deferred rows" in warning and "ks.drain" in warning
    assert warning in caplog.text
    with pytest.raises(StewardError, match="cannot drain now: checkpoint 4 is pending"):
        d.request("state.begin", name="s", drain=True)   # batch 4 is running
    rig.run(4, [5, 0])
    assert not d.request("state.begin", name="s", batch_id=5)["backlog_warning"]   # shrank: growth 0
    rig.run(5, [7, 0])

    # the drain: aligned although the state is unaligned, replays subtask 0's backlog, defers nothing
    drained = d.request("state.begin", name="s", drain=True)
    assert drained["checkpoint_id"] == 6 and not drained["unaligned"]
    opens = rig.run(6, [0, 0])
    assert all(o["alignment"]["alignment"] == "aligned" and o["deadline_in"] is None for o in opens)
    assert len(opens[0]["replay"]) == 1 and opens[1]["replay"] == []
    info = d.request("state.info", name="s")
    assert info["backlog"]["bytes"] == 0 and info["backlog"]["rows"] == 0 and info["drains"] == [6]
    assert d.request("state.begin", name="s", drain=True)["checkpoint_id"] is None   # nothing left to drain
    assert DrainLog.read(rig.states.registered("s").coordinator.storage.location).drains == (6,)

    # Spark's next batch is 6: it gets checkpoint 7 and its own rows, not a re-run of the drain
    begun = d.request("state.begin", name="s", batch_id=6)
    assert (begun["checkpoint_id"], begun["rerun"], begun["unaligned"]) == (7, False, True)
    opens = rig.run(7, [3, 0])
    assert opens[0]["alignment"]["alignment"] == "unaligned" and opens[0]["deadline_in"] is not None
    rig.close()

    # after a restart the drain ids are read back: batch 6 again is a re-run of checkpoint 7
    again = Rig(tmp_path, "b")
    try:
        assert again.d.request("state.info", name="s")["drains"] == [6]
        begun = again.d.request("state.begin", name="s", batch_id=6)
        assert (begun["checkpoint_id"], begun["rerun"]) == (7, True)
        assert again.d.request("state.begin", name="s", batch_id=7)["checkpoint_id"] == 8
    finally:
        again.close()


def test_drain_ids_map_every_batch_past_them_and_a_bad_record_is_named(tmp_path):
    log = DrainLog().with_drain(3).with_drain(4).with_drain(9)
    assert [log.checkpoint_of(b) for b in range(9)] == [0, 1, 2, 5, 6, 7, 8, 10, 11]
    assert DrainLog.from_bytes(log.to_bytes(), "x") == log
    with pytest.raises(CorruptRecordError, match="drain record /some/_drains is unreadable"):
        DrainLog.from_bytes(b'{"version": 1, "drains": [4, 3]}', "/some/_drains")
    assert growth({1: 5, 2: 6, 3: 7, 4: 8}) == 3 and growth({1: 5, 2: 6, 3: 6}) == 0 and growth({1: None, 2: 3}) == 0


def _replay_file(path, batch: pa.RecordBatch) -> list[dict]:
    w = ChannelStateWriter(path)
    w.append(batch)
    w.close()
    return [{"name": f"channel state {path.name}", "path": str(path)}]


@pytest.mark.parametrize("unaligned", [False, True])
def test_a_new_input_schema_while_rows_are_deferred_is_refused_naming_the_fix(tmp_path, unaligned):
    old = pa.RecordBatch.from_pydict({"k": ["a", "b"], "v": pa.array([1, 2], pa.int64())})
    new = pa.RecordBatch.from_pydict({"k": ["c"], "v": pa.array([1.5], pa.float64())})
    same = pa.RecordBatch.from_pydict({"k": ["c"], "v": pa.array([3], pa.int64())})
    opened = {"replay": _replay_file(tmp_path / "ch", old), "key_type": "string", "channel": str(tmp_path / "out"),
              "alignment": UNALIGNED if unaligned else None, "deadline_in": 60.0 if unaligned else None, "cut": None}

    def feed(batch):
        if unaligned:   # the task adds the key-group column to an unaligned state's new input
            batch = batch.append_column(KG_COL, pa.array([1] * batch.num_rows, pa.int32()))
        source, writer, _ = unaligned_input(opened, iter([batch]), "k", KeyGroupRange(0, M), M,
                                             lambda cut, overflow: cut, "subtask 0 of checkpoint 4 of keyed state 's'")
        try:
            return [b.num_rows for b in source]
        finally:
            if writer is not None:
                writer.abort()

    assert feed(same) == [2, 1]
    with pytest.raises(StateError) as err:
        feed(new)
    msg = str(err.value)
    assert "subtask 0 of checkpoint 4 of keyed state 's'" in msg
    assert "(k string, v double)" in msg and "(k string, v int64)" in msg
    assert "Drain the deferred rows with an aligned batch (ks.drain(...)) before changing the input schema" in msg
