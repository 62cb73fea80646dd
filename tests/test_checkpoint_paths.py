"""Paths that peers send, and the durable size of merged files, at the driver agent's coordinator
(Spark-free, real file:// storage and a real FileMerger): an ack or a seal names only data files it
has business with, deletion never reaches anything outside ``shared/`` and ``merged/``, and a
checkpoint completes only once every segment it references (state and channel state) lies within
a size a seal reported, which its record lists."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparksteward.blob.key import hash_file
from sparksteward.checkpoint.coordinator import CheckpointCoordinator
from sparksteward.checkpoint.merging import FileMerger, MergingMode, MergingOptions
from sparksteward.checkpoint.records import FileHandle, SubtaskHandle
from sparksteward.checkpoint.restore import restore_from
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.errors import CheckpointError, InvalidRecordError, StewardError
from sparksteward.state.keygroups import key_group_range

from tests.test_checkpoint_merging import Rig

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
    assert coord.acked(1) == set()
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
    assert coord.acked(1) == set()
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
    agent a wrote, nor a file no ack listed; nothing of a refused seal is recorded."""
    storage = CheckpointStorage.open(str(tmp_path / "chk"), "s")
    coord = CheckpointCoordinator(storage, 1, M, merging=MergingOptions())
    merger = FileMerger(tmp_path / "staging")
    current = _shared(storage, tmp_path, "CURRENT", b"MANIFEST-000001\n")
    coord.begin(0)
    seg = _segment(merger, storage, tmp_path, 0, MergingOptions(), "000001.sst", b"a" * 100)
    coord.ack(0, _handle(current, seg), uploaded=(current.path,), merged=(seg.path,), agent="a")
    for agent, files in (("b", {seg.path: 100}), ("a", {seg.path: 100, "merged/" + "e" * 32: 5})):
        with pytest.raises(InvalidRecordError, match=rf"seal of checkpoint 0 of state 's' by executor agent "
                                                     rf"'{agent}': \['merged/.*'\] are not merged files its acks "
                                                     rf"listed"):
            coord.sealed(0, files, agent)
    assert coord.sealed_files(0) == {} and coord.unsealed(0) == {seg.path: "a"}
    with pytest.raises(CheckpointError, match=r"1 merged files are not sealed yet by executor agents \['a'\]"):
        coord.complete(0)
    _seal(coord, merger, storage, 0, "a")
    assert coord.complete(0).properties["merged"] == {seg.path: 100}
    merger.close()


def test_hostile_acks_over_the_driver_agents_socket_are_refused_and_delete_nothing(tmp_path):
    """Through state.ack: an ack whose upload or handle names the state's record is refused by name;
    the checkpoint's abort and a restart of the coordinator then leave every record and referenced
    file in place."""
    rig = Rig(tmp_path, str(tmp_path / "chk"), parallelism=1, executors=1)
    try:
        rig.batch(0, {"a": 1})
        handle = rig.storage.read_metadata(0).subtasks[0].to_json()
        rig.dconn.request("state.begin", name="s", checkpoint_id=1)
        with pytest.raises(StewardError, match=r"uploaded files \['chk-0/_metadata'\] are not data files"):
            rig.dconn.request("state.ack", name="s", checkpoint_id=1, handle=handle, uploaded=["chk-0/_metadata"],
                              agent="x")
        evil = {**handle, "files": [{**handle["files"][0], "path": "chk-0/_metadata"}, *handle["files"][1:]]}
        with pytest.raises(StewardError, match=r"its handle references \['chk-0/_metadata'\]"):
            rig.dconn.request("state.ack", name="s", checkpoint_id=1, handle=evil, agent="x")
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
    rig = Rig(tmp_path, str(tmp_path / "chk"), parallelism=1, executors=1)
    try:
        rig.batch(0, {"a": 1})
        handle = rig.storage.read_metadata(0).subtasks[0].to_json()
        merged = sorted({f["path"] for f in handle["files"] if f["path"].startswith("merged/")})
        assert merged
        rig.dconn.request("state.begin", name="s", checkpoint_id=1)
        rig.dconn.request("state.ack", name="s", checkpoint_id=1, handle=handle, merged=merged, agent="x")
        with pytest.raises(StewardError, match=r"by executor agent 'y'.*are not merged files its acks listed"):
            rig.dconn.request("state.sealed", name="s", checkpoint_id=1, agent="y",
                              files=[{"path": p, "size": 1 << 30} for p in merged])
        assert rig.states._states["s"].coordinator.sealed_files(1) == {}
        rig.dconn.request("state.abort", name="s", checkpoint_id=1)
        assert rig.storage.stored_files() == rig.referenced()
    finally:
        rig.close()