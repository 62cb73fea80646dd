"""The state.* ops of the driver and executor agents over real authenticated sockets, without Spark
(issue 8): a task's open -> snapshot -> upload -> ack -> commit, commit waiting for late acks, a
failed upload aborting the checkpoint, and requests with bad fields refused by name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from sparksteward.checkpoint.coordination.driver_service import StateService
from sparksteward.checkpoint.filemerging.file_merger import MergingOptions
from sparksteward.checkpoint.task.task_state import SubtaskService
from sparksteward.errors import CheckpointError, InvalidRequestError, StewardError
from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.keygroups import key_group, key_group_range, subtask_for_key_group
from sparksteward.wire import AgentServer, Connection, new_secret

from tests.helpers.state import split_by_subtask, state_agents, timed, write_subtask

pytestmark = pytest.mark.usefixtures("guarded_rmtree")  # deletes stay under tmp_path

P, M = 2, 8


@pytest.fixture(params=["merged", "whole"])
def rig(tmp_path, request):
    """Driver and executor agents; checkpoints with file merging (FLIP-306) on, and off."""
    with state_agents(tmp_path, P, M, merging=MergingOptions(enabled=request.param == "merged")) as (d, e, sub, _):
        yield d, e, sub, tmp_path


def run_task(econn, cid: int, subtask: int, delta: dict[str, int]) -> float:
    opened = econn.request("state.open", name="s", checkpoint_id=cid, subtask=subtask)
    return write_subtask(econn, opened, subtask, P, M, delta)


def split(delta: dict[str, int]) -> list[dict[str, int]]:
    return split_by_subtask(delta, P, M)


def test_open_upload_ack_commit_and_rerun_from_the_same_base(rig):
    dconn, econn, subtasks, tmp = rig
    keys = {f"k{i}": i for i in range(10)}
    assert dconn.request("state.begin", name="s", checkpoint_id=None)["checkpoint_id"] == 0
    for i, part in enumerate(split(keys)):
        run_task(econn, 0, i, part)
    assert dconn.request("state.commit", name="s", checkpoint_id=0, wait=30)["checkpoint_id"] == 0
    # checkpoint 1, applied twice (a retried batch): both attempts start from checkpoint 0
    for _ in range(2):
        dconn.request("state.begin", name="s", checkpoint_id=1)   # the driver applies the batch; only it begins
        for i, part in enumerate(split(keys)):
            run_task(econn, 1, i, part)
    meta = dconn.request("state.commit", name="s", checkpoint_id=None, wait=30)["metadata"]
    assert meta["checkpoint_id"] == 1 and meta["properties"]["base"] == 0
    assert subtasks.open_subtasks() == 0
    assert not any((subtasks.root / "work").iterdir())
    # the values are those of exactly two applications
    from tests.helpers.keyed import read_values

    got = dict(read_values(str(tmp / "chk"), "s", "c1", meta))
    assert {k: int(v) for k, v in got.items()} == {k: 2 * v for k, v in keys.items()}


def test_commit_and_info_report_every_subtasks_sync_phase(rig):
    dconn, econn, subtasks, tmp = rig
    dconn.request("state.begin", name="s", checkpoint_id=0)
    sync = [run_task(econn, 0, i, part) for i, part in enumerate(split({f"k{i}": i for i in range(10)}))]
    stats = dconn.request("state.commit", name="s", checkpoint_id=0, wait=30)["stats"]
    assert stats["sync_ms"] == pytest.approx(sync)  # per subtask, in subtask order
    assert stats["sync_ms_max"] == pytest.approx(max(sync))
    assert dconn.request("state.info", name="s")["checkpoints"][0]["sync_ms"] == pytest.approx(sync)


def test_commit_times_out_and_aborts_when_a_subtask_never_acks(rig):
    dconn, econn, subtasks, tmp = rig
    dconn.request("state.begin", name="s", checkpoint_id=0)
    run_task(econn, 0, 0, {"a": 1} if subtask_for_key_group(M, P, key_group("a", M)) == 0 else {"b": 1})
    with pytest.raises(CheckpointError, match=r"subtasks \[1\] of 2 have not acked.*aborted"):
        dconn.request("state.commit", name="s", checkpoint_id=0, wait=1)
    assert dconn.request("state.info", name="s")["pending"] == []
    assert not (tmp / "chk" / "c1" / "s" / "chk-0").exists()


def test_a_released_task_leaves_nothing_and_bad_fields_are_named(rig):
    dconn, econn, subtasks, tmp = rig
    dconn.request("state.begin", name="s", checkpoint_id=0)
    opened = econn.request("state.open", name="s", checkpoint_id=0, subtask=1)
    assert Path(opened["workdir"]).is_dir()
    assert econn.request("state.release", token=opened["token"])["released"] is True
    assert not Path(opened["workdir"]).exists()
    with pytest.raises(InvalidRequestError, match="state.begin: field 'checkpoint_id' = 'x'"):
        dconn.request("state.begin", name="s", checkpoint_id="x")
    with pytest.raises(InvalidRequestError, match="state.open: subtask 5 is out of range for parallelism 2"):
        econn.request("state.open", name="s", checkpoint_id=0, subtask=5)
    for bad in (-1, (1 << 63) - 1, "soon"):   # the batch's processing time, from a lying task
        with pytest.raises(InvalidRequestError, match="state.open: field 'now_ms'"):
            econn.request("state.open", name="s", checkpoint_id=0, subtask=0, now_ms=bad)
    with pytest.raises(StewardError, match="keyed state 'nope' is not registered"):
        dconn.request("state.info", name="nope")
    # a lying task: bad timings and counters are refused by name, and its subtask stays open to release
    opened = econn.request("state.open", name="s", checkpoint_id=0, subtask=0)
    with pytest.raises(InvalidRequestError, match="state.upload: field 'flush_ms' = -1 .*a finite number >= 0"):
        econn.request("state.upload", token=opened["token"], sync_ms=1.0, flush_ms=-1)
    with pytest.raises(InvalidRequestError, match="state.upload counters: field 'wal_bytes' = 'lots'"):
        econn.request("state.upload", token=opened["token"], counters={"wal_bytes": "lots"})
    with pytest.raises(InvalidRequestError, match="state.upload counters: field 'unaligned' = 2"):
        econn.request("state.upload", token=opened["token"], counters={"unaligned": 2})
    assert econn.request("state.release", token=opened["token"])["released"] is True
    assert not Path(opened["workdir"]).exists()


def test_an_aborted_checkpoint_leaves_nothing_and_its_stragglers_cannot_restart_it(rig, monkeypatch):
    import threading

    from sparksteward.checkpoint.task import transfer

    from tests.helpers import wait_until

    dconn, econn, subtasks, tmp = rig
    root = tmp / "chk" / "c1" / "s"
    gate = threading.Event()  # holds the async phase until the checkpoint is aborted: the acks come late
    real_upload = transfer.upload_snapshot

    def held_upload(self, *args, **kwargs):
        gate.wait(30)
        return real_upload(self, *args, **kwargs)

    monkeypatch.setattr(transfer, "upload_snapshot", held_upload)
    dconn.request("state.begin", name="s", checkpoint_id=0)
    for i, part in enumerate(split({f"k{i}": i for i in range(10)})):
        run_task(econn, 0, i, part)
    dconn.request("state.abort", name="s", checkpoint_id=0)  # the sink failed; both uploads are in flight
    gate.set()
    wait_until(lambda: subtasks.uploader.pending() == 0 and not subtasks.merger.pending(), timeout=30,
               what="the uploads, and the merged files discarded")
    def data() -> list[Path]:
        return [p for d in ("shared", "merged") if (root / d).is_dir() for p in (root / d).iterdir()]

    # uploaded after the abort, refused, deleted in the background (merged: never sealed)
    wait_until(lambda: data() == [], timeout=10, what=f"the refused uploads deleted: {data()}")
    assert not any((subtasks.merger.staging).iterdir())
    with pytest.raises(StewardError, match=r"checkpoint 0 of state 's' was aborted: a task of the abandoned "
                                           r"attempt cannot start it again; apply the batch again"):
        econn.request("state.open", name="s", checkpoint_id=0, subtask=0)
    assert dconn.request("state.info", name="s")["pending"] == []
    dconn.request("state.begin", name="s", checkpoint_id=0)  # the driver applies the batch again
    for i, part in enumerate(split({"a": 1, "b": 2})):
        run_task(econn, 0, i, part)
    assert dconn.request("state.commit", name="s", checkpoint_id=0, wait=30)["checkpoint_id"] == 0


def test_the_agent_folds_a_wal_past_wal_flush_size_before_the_upload(rig):
    """Decision 0012: the task's snapshot keeps the batch in the WAL; the executor agent turns a WAL past
    its limit (64 KB here) into an SST in the async phase, so the next task replays almost nothing."""
    dconn, econn, subtasks, tmp = rig
    subtasks.wal_flush_bytes = 64 << 10
    many = {f"key-{i}-{os.urandom(40).hex()}": 1 for i in range(4000)}  # > 64 KB of compressed WAL per subtask
    few = {next(iter(many)): 1}
    for cid, delta in enumerate([many, few]):
        dconn.request("state.begin", name="s", checkpoint_id=cid)
        for i, part in enumerate(split(delta)):
            run_task(econn, cid, i, part)
        meta = dconn.request("state.commit", name="s", checkpoint_id=cid, wait=30)["metadata"]
        for i, sub in enumerate(meta["subtasks"]):
            names = [f["name"] for f in sub["files"]]
            wal = sum(f["length"] for f in sub["files"] if f["name"].endswith(".log"))
            if cid == 0:  # folded: the 4000 keys are in an SST, no WAL left
                assert any(n.endswith(".sst") for n in names) and wal == 0, sub["files"]
            else:  # one key's write, under the limit: kept as a WAL by the subtask that owns it
                # (an empty ZSTD-compressed WAL still records its compression type: a few bytes)
                assert (wal > 32) == bool(split(few)[i]) and wal < 64 << 10, sub["files"]
    dconn.request("state.begin", name="s", checkpoint_id=2)
    opened = econn.request("state.open", name="s", checkpoint_id=2, subtask=0)
    with RocksDBStateBackend(opened["workdir"], key_group_range(M, P, 0), M, "string", create=False) as b:
        assert b.wal_bytes < 64 << 10
        part = split(many)[0]
        assert b.value("value").get_many(list(part)) == [2 if k in few else 1 for k in part]
    econn.request("state.release", token=opened["token"])


# --- attempt identity ------------------------------------------------------------------------------
def _handle_of(dconn, econn, cid: int, subtask: int, delta: dict[str, int]) -> tuple[dict, dict]:
    """A subtask's upload as an executor agent acks it, without the ack: (handle, the open reply)."""
    from sparksteward.checkpoint.storage import CheckpointStorage
    from sparksteward.checkpoint.task.transfer import upload_snapshot

    opened = econn.request("state.open", name="s", checkpoint_id=cid, subtask=subtask)
    backend = RocksDBStateBackend(opened["workdir"], key_group_range(M, P, subtask), M, "string", create=False)
    vs = backend.value("value")
    for k, d in delta.items():
        vs.update(k, d)
    snap = backend.snapshot(opened["snapshot"])
    backend.close()
    storage = CheckpointStorage.open(dconn.request("state.info", name="s")["checkpoint_dir"], "s", "c1")
    result = upload_snapshot(storage, snap.path, subtask, key_group_range(M, P, subtask))
    econn.request("state.release", token=opened["token"])
    return result.handle.to_json(), opened, list(result.uploaded)


def test_an_ack_or_failure_of_a_replaced_attempt_is_refused(rig):
    """Every begin starts a new attempt with a new token: an ack of the replaced one (a driver that
    began again, a restarted driver agent) is refused, and a failure report of it, or of a subtask
    that another copy acked, no longer aborts a checkpoint."""
    dconn, econn, subtasks, tmp = rig
    keys = {f"k{i}": i for i in range(10)}
    first = dconn.request("state.begin", name="s", checkpoint_id=0)
    handle, opened, uploaded = _handle_of(dconn, econn, 0, 0, split(keys)[0])
    old_attempt = opened["attempt"]
    assert old_attempt
    dconn.request("state.begin", name="s", checkpoint_id=0)   # the driver applies the batch again
    with pytest.raises(CheckpointError, match="begun again since"):
        dconn.request("state.ack", name="s", checkpoint_id=0, handle=handle, uploaded=uploaded, agent="old",
                      attempt=old_attempt)
    for i, part in enumerate(split(keys)):
        run_task(econn, 0, i, part)
    # late failure reports: of the replaced attempt, and of a speculative copy of a subtask that acked
    assert dconn.request("state.fail", name="s", checkpoint_id=0, subtask=0, message="late copy",
                         attempt=old_attempt)["ignored"] is True
    with pytest.raises(StewardError, match=r"field 'attempt'"):   # a report naming no attempt is refused
        dconn.request("state.fail", name="s", checkpoint_id=0, subtask=0, message="no token")
    from tests.helpers import wait_until

    wait_until(lambda: subtasks.uploads_in_flight() == 0, timeout=30, what="every subtask's ack")
    current = econn.request("state.open", name="s", checkpoint_id=0, subtask=1)   # a speculative copy
    econn.request("state.release", token=current["token"])
    dconn.request("state.fail", name="s", checkpoint_id=0, subtask=1, message="speculative copy lost",
                  attempt=current["attempt"])
    assert dconn.request("state.commit", name="s", checkpoint_id=0, wait=30)["checkpoint_id"] == 0
    assert first["checkpoint_id"] == 0


def test_a_task_cannot_begin_a_checkpoint_on_a_fresh_driver_agent(tmp_path):
    """A straggler task of a lost attempt opens its subtask after the driver agent restarted: it may
    not create a pending checkpoint there (its files would be the only trace of an attempt nobody
    commits); the driver's own begin of the batch is what starts it again."""
    secret = new_secret()
    driver = AgentServer("127.0.0.1", 0, secret, {})
    states = StateService(str(tmp_path / "chk"), "c1", commit_timeout=30)
    states.register_handlers(driver)
    executor = AgentServer("127.0.0.1", 0, secret, {})
    subtasks = SubtaskService(tmp_path / "exec", driver.endpoint, secret, upload_threads=2)
    subtasks.register_handlers(executor)
    try:
        with Connection.connect(driver.endpoint, secret) as dconn, Connection.connect(executor.endpoint, secret) as econn:
            dconn.request("state.register", name="s", checkpoint_dir=None, parallelism=P, max_parallelism=M,
                          key_type="string", num_retained=1)
            with pytest.raises(CheckpointError, match="was not begun by this driver agent"):
                econn.request("state.open", name="s", checkpoint_id=4, subtask=0)
            assert dconn.request("state.info", name="s")["pending"] == []
            dconn.request("state.begin", name="s", checkpoint_id=4)
            opened = econn.request("state.open", name="s", checkpoint_id=4, subtask=0)
            econn.request("state.release", token=opened["token"])
    finally:
        subtasks.close()
        executor.close()
        driver.close()
        states.close()


def test_a_lying_peer_cannot_record_a_cut_outside_its_subtask(rig):
    """state.cut from a peer: a cut outside the subtask's key groups, or of a subtask the state does
    not have, is refused by name and records nothing; the first valid proposal stands."""
    dconn, econn, subtasks, tmp = rig
    dconn.request("state.begin", name="s", checkpoint_id=0)
    stop = key_group_range(M, P, 0).stop
    with pytest.raises(StewardError, match=rf"cut {stop + 1} of subtask 0 lies outside its key groups"):
        dconn.request("state.cut", name="s", checkpoint_id=0, subtask=0, cut=stop + 1)
    with pytest.raises(StewardError, match=rf"cut {stop} \(after 3 of its rows\) of subtask 0 lies outside"):
        dconn.request("state.cut", name="s", checkpoint_id=0, subtask=0, cut=stop, rows=3)   # no rows past the end
    with pytest.raises(StewardError, match=r"rows"):
        dconn.request("state.cut", name="s", checkpoint_id=0, subtask=0, cut=1, rows=-1)
    with pytest.raises(StewardError, match=r"subtask"):
        dconn.request("state.cut", name="s", checkpoint_id=0, subtask=P + 5, cut=0)
    assert dconn.request("state.cut", name="s", checkpoint_id=0, subtask=0, cut=1)["cut"] == 1
    assert dconn.request("state.cut", name="s", checkpoint_id=0, subtask=0, cut=0)["cut"] == 1


def test_the_deletes_of_a_commit_run_outside_the_states_lock(tmp_path, s3):
    """Item 10: the files a commit subsumes are deleted on the coordinator's deleter thread. While
    every delete request takes 1 s, the same state's info and an executor agent's heartbeat are answered
    at once (the subsume deleted under the state's lock before); the commit still replies only once
    its deletes are done, and the next begin starts after them."""
    import threading
    import uuid

    from tests.helpers import wait_until

    secret = new_secret()
    driver = AgentServer("127.0.0.1", 0, secret, {})
    states = StateService(s3.url(f"chk-{uuid.uuid4().hex[:8]}"), "c1", commit_timeout=60,
                          merging=MergingOptions(enabled=False))   # whole files: each snapshot has its own MANIFEST
    states.register_handlers(driver)
    executor = AgentServer("127.0.0.1", 0, secret, {})
    subtasks = SubtaskService(tmp_path / "exec", driver.endpoint, secret, upload_threads=2)
    subtasks.register_handlers(executor)
    dconn, other, econn = (Connection.connect(driver.endpoint, secret), Connection.connect(driver.endpoint, secret),
                           Connection.connect(executor.endpoint, secret))
    try:
        dconn.request("state.register", name="s", checkpoint_dir=None, parallelism=P, max_parallelism=M,
                      key_type="string", num_retained=1)
        for cid in range(2):
            dconn.request("state.begin", name="s", checkpoint_id=cid)
            for i, part in enumerate(split({f"k{j}": j + cid for j in range(50)})):
                run_task(econn, cid, i, part)
            dconn.request("state.commit", name="s", checkpoint_id=cid, wait=60)
        mark = s3.mark()
        done = []

        def batch_2():   # its begin subsumes checkpoint 0 (a re-run of 1 can no longer come)
            dconn.request("state.begin", name="s", checkpoint_id=2)
            for i, part in enumerate(split({f"k{j}": j + 2 for j in range(50)})):
                run_task(econn, 2, i, part)
            done.append(dconn.request("state.commit", name="s", checkpoint_id=2, wait=60))

        with s3.slow("DeleteObjects", 1.0):   # s3fs deletes with POST ?delete
            t = threading.Thread(target=batch_2, daemon=True)
            t.start()
            wait_until(lambda: any(op == "DeleteObjects" for op, _ in s3.in_flight()), timeout=30,
                       what="checkpoint 0's files to be deleted")
            timings = timed({
                "info": lambda: other.request("state.info", name="s"),
                "heartbeat": lambda: other.request("state.merge_poll", agent="exec-1", wait=0, pools=[], closed=[],
                                                   working=[]),
            })
            deleting = any(op == "DeleteObjects" for op, _ in s3.in_flight())
            t.join(120)
        deletes = [r for r in s3.requests_since(mark) if r.op == "DeleteObjects"]
        assert done and done[0]["checkpoint_id"] == 2
        assert deleting and len(deletes) >= 2, (timings, len(deletes), "checkpoint 0 must be deleted, slowly")
        assert max(timings.values()) < 0.8, timings
        assert not states.registered("s").coordinator.deleter.queued(), "the commit replies after its deletes"
        assert other.request("state.info", name="s")["retained"] == [1, 2]
    finally:
        for c in (dconn, other, econn):
            c.close()
        subtasks.close()
        executor.close()
        driver.close()
        states.close()
