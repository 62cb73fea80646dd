"""Paths that peers send, and the durable size of merged files, at the driver agent's coordinator
(Spark-free, real file:// storage and a real FileMerger): an ack or a seal names only data files it
has business with, deletion never reaches anything outside ``shared/`` and ``merged/``, and a
checkpoint completes only once every segment it references (state and channel state) lies within
a size a seal reported, which its record lists."""

from __future__ import annotations

from pathlib import Path

import pytest
from sparksteward.checkpoint.coordination.coordinator import CheckpointCoordinator
from sparksteward.checkpoint.filemerging.file_merger import FileMerger, MergingMode, MergingOptions
from sparksteward.checkpoint.records import FileHandle, SubtaskHandle
from sparksteward.checkpoint.restore import restore_from
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.errors import CheckpointError, InvalidRecordError, InvalidRequestError, StewardError
from sparksteward.hashing import hash_file
from sparksteward.state.keygroups import key_group_range

from tests.helpers.merging import MergingRig

M = 8
ACROSS = MergingOptions(mode=MergingMode.ACROSS)


def _local(tmp: Path, name: str, data: bytes) -> Path:
    p = tmp / "src" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


def _shared(storage: CheckpointStorage, tmp: Path, name: str, data: bytes) -> FileHandle:
    """A whole file uploaded to shared/<checksum>, as upload_snapshot does."""
    local = _local(tmp, name, data)
    checksum = hash_file(local).hex()
    storage.put_file(local, f"shared/{checksum}")
    return FileHandle(name, f"shared/{checksum}", len(data), checksum)


def _segment(merger: FileMerger, storage: CheckpointStorage, tmp: Path, cid: int, opts: MergingOptions,
             name: str, data: bytes) -> FileHandle:
    local = _local(tmp, f"{cid}-{name}", data)
    target = storage.local_target if opts.mode is MergingMode.ACROSS else None
    return merger.append(storage.url, cid, opts, name, local, hash_file(local).hex(), put=storage.put_file,
                         target=target)


def _handle(*files: FileHandle, channel: tuple[FileHandle, ...] = ()) -> SubtaskHandle:
    return SubtaskHandle(0, key_group_range(M, 1, 0), files, channel)


def _seal(coord: CheckpointCoordinator, merger: FileMerger, storage: CheckpointStorage, cid: int,
          agent: str = "") -> dict[str, int]:
    files = {f.path: f.size for f in merger.seal(storage.url, cid)}
    if agent:
        coord.sealed(cid, files, agent)
    else:
        coord.sealed(cid, files)
    return files

def _merging_state(tmp: Path, merging: MergingOptions) -> tuple[CheckpointStorage, CheckpointCoordinator,
                                                                  FileMerger, FileHandle]:
    """A one-subtask state with file merging: its storage, coordinator, an executor's merger and a
    whole CURRENT file for its handles."""
    storage = CheckpointStorage.open(str(tmp / "chk"), "s")
    coord = CheckpointCoordinator(storage, 1, M, merging=merging)
    return storage, coord, FileMerger(tmp / "staging"), _shared(storage, tmp, "CURRENT", b"MANIFEST-000001\n")



@pytest.fixture
def chk0(tmp_path):
    """A state with one completed checkpoint (parallelism 1): storage, coordinator, its CURRENT."""
    storage = CheckpointStorage.open(str(tmp_path / "chk"), "s")
    coord = CheckpointCoordinator(storage, 1, M)
    current = _shared(storage, tmp_path, "CURRENT", b"MANIFEST-000001\n")
    coord.begin(0)
    coord.ack(0, _handle(current), uploaded=(current.path,))
    coord.complete(0)
    return storage, coord, current


# --- item: paths that peers send ---------------------------------------------------------------------
def test_an_ack_naming_a_record_as_its_upload_is_refused_and_deletes_nothing(tmp_path, chk0):
    """An ack whose uploads name ``chk-0/_metadata`` (no ``..``) is refused by name before anything
    is recorded: neither the abort of its checkpoint nor a late ack deletes the record, and a
    restarted coordinator still has checkpoint 0 and sweeps nothing."""
    storage, coord, current = chk0
    record = "chk-0/_metadata"
    coord.begin(1)
    with pytest.raises(InvalidRecordError, match=r"uploaded files \['chk-0/_metadata'\] are not data files its "
                                                 r"handle references.*shared/<32 hex checksum> or merged/<32 hex>"):
        coord.ack(1, _handle(current), uploaded=(record,))
    assert coord.snapshot(1).acked == set()
    coord.abort(1)
    # a late ack (checkpoint 2 was never begun) is refused by the same check, not as late
    with pytest.raises(InvalidRecordError, match=r"uploaded files \['chk-0/_metadata'\]"):
        coord.ack(2, _handle(current), uploaded=(record,))
    assert storage.read_metadata(0).checkpoint_id == 0
    restarted = CheckpointCoordinator(storage, 1, M)
    assert restarted.retained() == [0] and restarted.swept == 0
    assert storage.shared_files() == {current.path}


@pytest.mark.parametrize("path", ["chk-0/_metadata", "restored/_metadata", "shared/" + "A" * 32,
                                  "merged/" + "0" * 32 + "/x", "file:///etc/passwd"])
def test_a_handle_path_outside_the_data_files_and_the_base_is_refused(tmp_path, chk0, path):
    storage, coord, current = chk0
    coord.begin(1)
    bad = FileHandle("000009.sst", path, 16, "0" * 32)
    with pytest.raises(InvalidRecordError, match=rf"ack of subtask 0 of checkpoint 1 of state 's': its handle "
                                                 rf"references \['{path}'\], which are neither data files "
                                                 rf"\(shared/<32 hex checksum> or merged/<32 hex>\) nor files "
                                                 rf"its base checkpoint 0 or a claimed checkpoint holds"):
        coord.ack(1, _handle(current, bad))
    assert coord.snapshot(1).acked == set()
    coord.ack(1, _handle(current))   # the base's own paths are fine
    assert coord.complete(1).subtasks[0].files == (current,)


def test_deletion_helpers_delete_only_data_files(tmp_path, chk0):
    storage, coord, current = chk0
    outside = tmp_path / "outside"
    outside.write_bytes(b"x")
    junk = storage.location.path("shared", "README")
    storage.location.write_atomic(junk, b"x")
    assert storage.delete_files(["chk-0/_metadata"]) == 0
    assert storage.delete_files(["restored/_metadata", f"file://{outside}", str(outside), "shared/README",
                                 "shared", "merged/../chk-0/_metadata", "merged/" + "0" * 32 + "/.."]) == 0
    assert storage.read_metadata(0) and outside.exists() and storage.location.exists(junk)
    orphan = _shared(storage, tmp_path, "000001.sst", b"orphan")
    staged = storage.location.path("shared", f".{'0' * 32}.deadbeef.tmp")
    storage.location.write_atomic(staged, b"half")
    assert storage.delete_files([orphan.path, f"shared/.{'0' * 32}.deadbeef.tmp"]) == 2
    assert storage.shared_files() == {current.path, "shared/README"}


def test_a_seal_names_only_files_its_agent_acked(tmp_path):
    """Agent b cannot seal (and so complete the checkpoint on, or have deleted) a merged file that
    agent a wrote; a seal of a file no ack listed yet counts only once its own agent acks it."""
    storage, coord, merger, current = _merging_state(tmp_path, MergingOptions())
    coord.begin(0)
    seg = _segment(merger, storage, tmp_path, 0, MergingOptions(), "000001.sst", b"a" * 100)
    coord.ack(0, _handle(current, seg), uploaded=(current.path,), merged=(seg.path,), agent="a")
    with pytest.raises(InvalidRecordError, match=r"seal of checkpoint 0 of state 's' by executor agent "
                                                 r"'b': \['merged/.*'\] are not merged files its acks listed"):
        coord.sealed(0, {seg.path: 100}, "b")
    # a seal may come before the ack that lists a file (it covers the agent's whole pool): such a file
    # counts only once an ack of the same agent lists it, so b's early seal of a file a acks is void
    early = "merged/" + "e" * 32
    coord.sealed(0, {early: 5}, "b")
    assert coord.snapshot(0).sealed == {} and coord.snapshot(0).unsealed == {seg.path: "a"}
    with pytest.raises(CheckpointError, match=r"1 merged files are not sealed yet by executor agents \['a'\]"):
        coord.complete(0)
    _seal(coord, merger, storage, 0, "a")
    assert coord.complete(0).properties["merged"] == {seg.path: 100}
    merger.close()


def test_hostile_acks_over_the_driver_agents_socket_are_refused_and_delete_nothing(tmp_path):
    """Through state.ack: an ack whose upload or handle names the state's record is refused by name;
    the checkpoint's abort and a restart of the coordinator then leave every record and referenced
    file in place."""
    rig = MergingRig(tmp_path, str(tmp_path / "chk"), parallelism=1, executors=1)
    try:
        rig.batch(0, {"a": 1})
        handle = rig.storage.read_metadata(0).subtasks[0].to_json()
        rig.dconn.request("state.begin", name="s", checkpoint_id=1)
        with pytest.raises(StewardError, match=r"uploaded files \['chk-0/_metadata'\] are not data files"):
            rig.dconn.request("state.ack", name="s", checkpoint_id=1, handle=handle, uploaded=["chk-0/_metadata"],
                              agent="x", attempt="a")
        evil = {**handle, "files": [{**handle["files"][0], "path": "chk-0/_metadata"}, *handle["files"][1:]]}
        with pytest.raises(StewardError, match=r"its handle references \['chk-0/_metadata'\]"):
            rig.dconn.request("state.ack", name="s", checkpoint_id=1, handle=evil, agent="x", attempt="a")
        rig.dconn.request("state.abort", name="s", checkpoint_id=1)
        assert rig.storage.checkpoint_ids() == [0]
        assert rig.storage.stored_files() == rig.referenced()
    finally:
        rig.close()
    restarted = CheckpointCoordinator(CheckpointStorage.open(str(tmp_path / "chk"), "s", "c1"), 1, 64)
    assert restarted.retained() == [0] and restarted.swept == 0


def test_a_seal_by_another_agent_over_the_driver_agents_socket_is_refused(tmp_path):
    """Through state.sealed: agent y cannot seal the merged files agent x acked (and so have
    checkpoint 1 complete on them, at a size it made up)."""
    rig = MergingRig(tmp_path, str(tmp_path / "chk"), parallelism=1, executors=1)
    try:
        rig.batch(0, {"a": 1})
        handle = rig.storage.read_metadata(0).subtasks[0].to_json()
        merged = sorted({f["path"] for f in handle["files"] if f["path"].startswith("merged/")})
        assert merged
        attempt = rig.dconn.request("state.begin", name="s", checkpoint_id=1)["attempt"]
        rig.dconn.request("state.ack", name="s", checkpoint_id=1, handle=handle, merged=merged, agent="x",
                          attempt=attempt)
        with pytest.raises(StewardError, match=r"by executor agent 'y'.*are not merged files its acks listed"):
            rig.dconn.request("state.sealed", name="s", checkpoint_id=1, agent="y", attempt=attempt,
                              files=[{"path": p, "size": 1 << 30} for p in merged])
        assert rig.states.registered("s").coordinator.snapshot(1).sealed == {}
        rig.dconn.request("state.abort", name="s", checkpoint_id=1)
        assert rig.storage.stored_files() == rig.referenced()
    finally:
        rig.close()


def test_a_seal_of_a_replaced_attempt_records_nothing_and_a_seal_without_one_is_refused(tmp_path):
    """Item 4 for seals: agent x acked merged files in attempt A of checkpoint 1, which was then
    aborted and begun again (attempt B, the same ack again). x's seal asked for under A arrives now:
    it records no durable size for B (and deletes nothing); B's own seal does. A seal naming no
    attempt is refused by name."""
    rig = MergingRig(tmp_path, str(tmp_path / "chk"), parallelism=1, executors=1)
    try:
        rig.batch(0, {"a": 1})
        handle = rig.storage.read_metadata(0).subtasks[0].to_json()
        merged = sorted({f["path"] for f in handle["files"] if f["path"].startswith("merged/")})
        sizes = [{"path": p, "size": 1 << 20} for p in merged]
        old = rig.dconn.request("state.begin", name="s", checkpoint_id=1)["attempt"]
        rig.dconn.request("state.abort", name="s", checkpoint_id=1)
        new = rig.dconn.request("state.begin", name="s", checkpoint_id=1)["attempt"]
        assert new != old
        rig.dconn.request("state.ack", name="s", checkpoint_id=1, handle=handle, merged=merged, agent="x",
                          attempt=new)
        coord = rig.states.registered("s").coordinator
        rig.dconn.request("state.sealed", name="s", checkpoint_id=1, agent="x", attempt=old, files=sizes)
        assert coord.snapshot(1).sealed == {}, "a replaced attempt's seal must not count for the current one"
        with pytest.raises(StewardError, match=r"field 'attempt'"):
            rig.dconn.request("state.sealed", name="s", checkpoint_id=1, agent="x", files=sizes)
        rig.dconn.request("state.sealed", name="s", checkpoint_id=1, agent="x", attempt=new, files=sizes)
        assert coord.snapshot(1).sealed == {p: 1 << 20 for p in merged}
        assert rig.dconn.request("state.commit", name="s", checkpoint_id=1, wait=10)["checkpoint_id"] == 1
        assert rig.storage.stored_files() == rig.referenced()
    finally:
        rig.close()


# --- item: across-mode files are durable before a checkpoint completes on them ------------------------
def test_across_completes_only_once_the_appended_segments_are_sealed(tmp_path):
    """Checkpoint 1 appends to the physical file checkpoint 0 holds: it cannot complete until a
    seal covers the new segment, and its record lists the size that seal reported."""
    storage, coord, merger, current = _merging_state(tmp_path, ACROSS)
    coord.begin(0)
    seg0 = _segment(merger, storage, tmp_path, 0, ACROSS, "000001.sst", b"0" * 1000)
    coord.ack(0, _handle(current, seg0), uploaded=(current.path,), merged=(seg0.path,))
    assert coord.snapshot(0).unsealed == {seg0.path: ""}
    _seal(coord, merger, storage, 0)
    assert coord.complete(0).properties["merged"] == {seg0.path: 1000}

    coord.begin(1)
    seg1 = _segment(merger, storage, tmp_path, 1, ACROSS, "000002.sst", b"1" * 500)
    assert (seg1.path, seg1.offset) == (seg0.path, 1000)   # appended to checkpoint 0's file
    coord.ack(1, _handle(current, seg0, seg1), merged=(seg1.path,))
    assert coord.snapshot(1).unsealed == {seg1.path: ""}
    with pytest.raises(CheckpointError, match=r"checkpoint 1 of state 's' cannot complete: 1 merged files are "
                                              r"not sealed yet"):
        coord.complete(1)
    # a seal reporting less than the segments reach does not do either
    coord.sealed(1, {seg1.path: 1200})
    assert coord.snapshot(1).unsealed == {seg1.path: ""}
    _seal(coord, merger, storage, 1)
    meta = coord.complete(1)
    assert meta.properties["merged"] == {seg0.path: 1500}
    assert Path(storage.local_target(seg0.path)).stat().st_size == 1500
    merger.close()


# --- item: channel-state segments count like state segments ---------------------------------------------
def test_channel_state_segments_wait_for_their_seal_and_are_recorded(tmp_path):
    """A subtask whose only new segment is channel state (FLIP-76 deferred input merged into a
    physical file): the checkpoint waits for its seal and lists the file's size."""
    storage, coord, merger, current = _merging_state(tmp_path, MergingOptions())
    coord.begin(0)
    chan = _segment(merger, storage, tmp_path, 0, MergingOptions(), "channel-0.arrow", b"c" * 300)
    coord.ack(0, _handle(current, channel=(chan,)), uploaded=(current.path,), merged=(chan.path,))
    assert coord.snapshot(0).unsealed == {chan.path: ""}
    with pytest.raises(CheckpointError, match=r"1 merged files are not sealed yet"):
        coord.complete(0)   # the physical file is not even in the store yet
    _seal(coord, merger, storage, 0)
    meta = coord.complete(0)
    assert meta.properties["merged"] == {chan.path: 300}
    assert storage.stored_files() == meta.physical_paths()
    merger.close()


def test_an_across_file_only_channel_state_references_is_not_deleted_when_its_agent_closes_it(tmp_path):
    storage, coord, merger, current = _merging_state(tmp_path, ACROSS)
    coord.begin(0)
    chan = _segment(merger, storage, tmp_path, 0, ACROSS, "channel-0.arrow", b"c" * 300)
    coord.ack(0, _handle(current, channel=(chan,)), uploaded=(current.path,), merged=(chan.path,), agent="a")
    coord.files_closed("a", {chan.path})   # the agent rotated it (full): the pending ack still needs it
    assert storage.merged_files() == {chan.path}
    _seal(coord, merger, storage, 0, "a")
    assert coord.complete(0).physical_paths() == {current.path, chan.path}
    assert storage.merged_files() == {chan.path}
    merger.close()


def test_claimed_channel_state_files_are_recorded_as_claimed(tmp_path):
    """After a CLAIM restore, a checkpoint that still references the source's channel-state file
    records it in ``claimed``, so the state deletes it once no checkpoint needs it."""
    src = CheckpointStorage.open(str(tmp_path / "src"), "a")
    coord = CheckpointCoordinator(src, 1, M)
    current = _shared(src, tmp_path, "CURRENT", b"MANIFEST-000001\n")
    chan = _shared(src, tmp_path, "channel-0.arrow", b"deferred rows")
    coord.begin(0)
    coord.ack(0, _handle(current, channel=(chan,)), uploaded=(current.path, chan.path))
    coord.complete(0)
    dst = CheckpointStorage.open(str(tmp_path / "dst"), "b")
    restore_from(src.url_of("chk-0"), dst, max_parallelism=M, claim_mode="claim")
    coord = CheckpointCoordinator(dst, 1, M)
    begun = coord.begin(0)
    base = begun.base.subtasks[0]
    coord.ack(0, _handle(*base.files, channel=base.channel_state))
    meta = coord.complete(0)
    urls = {f.path for f in (*base.files, *base.channel_state)}
    assert len(urls) == 2 and sorted(meta.properties["claimed"]) == sorted(urls)
    assert coord.claimed() == urls


def test_an_ack_with_hostile_stats_is_refused_by_field_and_records_nothing(tmp_path):
    """The stats an ack carries are checked field by field when it arrives (they are summed at
    commit and in ks.info()): a wrong type is refused naming the field, and the ack is not taken."""
    rig = MergingRig(tmp_path, str(tmp_path / "chk"), parallelism=1, executors=1)
    try:
        rig.batch(0, {"a": 1})
        handle = rig.storage.read_metadata(0).subtasks[0].to_json()
        attempt = rig.dconn.request("state.begin", name="s", checkpoint_id=1)["attempt"]
        coord = rig.states.registered("s").coordinator
        for stats, field in (({"bytes": "lots"}, "bytes"), ({"sync_ms": -1.0}, "sync_ms"),
                             ({"unaligned": 1}, "unaligned"), ({"restore": [1]}, "restore")):
            with pytest.raises(InvalidRequestError, match=rf"state.ack stats: field '{field}'"):
                rig.dconn.request("state.ack", name="s", checkpoint_id=1, handle=handle, agent="x",
                                  attempt=attempt, stats=stats)
            assert coord.snapshot(1).acked == set()
        rig.dconn.request("state.ack", name="s", checkpoint_id=1, handle=handle, agent="x", attempt=attempt,
                          stats={"bytes": 7, "sync_ms": 1.5})
        reply = rig.dconn.request("state.commit", name="s", checkpoint_id=1, wait=10)
        assert reply["stats"]["bytes"] == 7 and reply["stats"]["sync_ms"] == [1.5]
    finally:
        rig.close()
