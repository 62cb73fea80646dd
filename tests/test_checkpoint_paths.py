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