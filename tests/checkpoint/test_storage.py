"""Checkpoint storage on file:// and moto S3: incremental uploads, verified restores through the local
content-addressed cache, metadata records and their errors."""

from __future__ import annotations

import os
import shutil

import orjson
import pytest
from sparksteward.checkpoint.records import CheckpointMetadata, FileHandle, SubtaskHandle
from sparksteward.checkpoint.storage import CheckpointStorage, open_checkpoint
from sparksteward.checkpoint.task.cache import LocalFileCache
from sparksteward.checkpoint.task.transfer import restore_subtask, upload_snapshot
from sparksteward.errors import CheckpointCorruptError, CheckpointNotFoundError, InvalidRecordError
from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.keygroups import KeyGroupRange

M = 16
ALL = KeyGroupRange(0, M)
N_KEYS = 60_000


def _fill(backend, lo, hi, tag):
    backend.value("v").put_many([f"user-{i}" for i in range(lo, hi)],
                                [{"n": i, "tag": tag, "pad": "p" * 40} for i in range(lo, hi)])


def _meta(storage, checkpoint_id, result):
    return CheckpointMetadata(state=storage.state, checkpoint_id=checkpoint_id, parallelism=1, max_parallelism=M,
                              subtasks=(result.handle,))


@pytest.fixture
def two_checkpoints(tmp_path, store_url):
    """Checkpoint 1 of 60k keys, then checkpoint 2 after updating 1% of them."""
    storage = CheckpointStorage.open(store_url, "clicks", "cluster-a")
    b = RocksDBStateBackend(tmp_path / "work", ALL, M)
    _fill(b, 0, N_KEYS, "first")
    s1 = b.snapshot(tmp_path / "snap-1")  # closes b: its WAL is part of the snapshot
    r1 = upload_snapshot(storage, s1.path, 0, ALL)
    storage.write_metadata(_meta(storage, 1, r1))
    (tmp_path / "work2").mkdir()  # the next task: a working copy of checkpoint 1, as a restore makes it
    shutil.copytree(s1.path, tmp_path / "work2" / "db", copy_function=os.link)
    for wal in (tmp_path / "work2" / "db").glob("*.log"):
        shutil.copyfile(s1.path / wal.name, str(wal) + ".tmp")
        os.replace(str(wal) + ".tmp", wal)
    b = RocksDBStateBackend(tmp_path / "work2", ALL, M, create=False)
    _fill(b, 0, N_KEYS // 100, "second")
    s2 = b.snapshot(tmp_path / "snap-2")
    r2 = upload_snapshot(storage, s2.path, 0, ALL, known={f.checksum for f in r1.handle.files})
    storage.write_metadata(_meta(storage, 2, r2))
    b.close()
    return storage, r1, r2


def test_incremental_checkpoint_uploads_only_new_files(two_checkpoints):
    storage, r1, r2 = two_checkpoints
    print(f"\ncheckpoint 1 uploaded {r1.bytes_uploaded} B in {len(r1.uploaded)} files; checkpoint 2 (1% "
          f"updated) uploaded {r2.bytes_uploaded} B in {len(r2.uploaded)} files, reused {r2.files_reused}")
    assert r1.files_reused == 0 and r1.bytes_uploaded == sum(f.length for f in r1.handle.files)
    assert r2.files_reused >= 1
    first = {f.checksum for f in r1.handle.files if f.name.endswith((".sst", ".log"))}
    assert first <= {f.checksum for f in r2.handle.files}  # the old SSTs and WALs are reused, not re-sent
    assert r2.bytes_uploaded < r1.bytes_uploaded / 5
    assert storage.checkpoint_ids() == [1, 2]
    assert storage.shared_files() == {f.path for f in (*r1.handle.files, *r2.handle.files)}


def test_restore_is_verified_and_reuses_the_local_cache(two_checkpoints, tmp_path):
    storage, r1, r2 = two_checkpoints
    cache = LocalFileCache(tmp_path / "cache")
    meta1 = storage.read_metadata(1)
    assert meta1 == _meta(storage, 1, r1)
    st1 = restore_subtask(storage, meta1, meta1.subtasks[0], tmp_path / "r1" / "db", cache)
    assert st1.downloaded_files == len(r1.handle.files) and st1.cached_files == 0
    with RocksDBStateBackend(tmp_path / "r1", ALL, M, create=False) as b:
        assert b.value("v").get("user-5")["tag"] == "first"
        assert sum(1 for _ in b.iter_raw()) == N_KEYS
    # the next checkpoint on the same executor downloads only what the cache lacks
    meta2 = storage.read_metadata(2)
    st2 = restore_subtask(storage, meta2, meta2.subtasks[0], tmp_path / "r2" / "db", cache)
    new_in_2 = {f.path for f in r2.handle.files} - {f.path for f in r1.handle.files}
    assert set(st2.fetched_paths) == new_in_2
    with RocksDBStateBackend(tmp_path / "r2", ALL, M, create=False) as b:
        assert b.value("v").get("user-5")["tag"] == "second"
        assert b.value("v").get("user-50000")["tag"] == "first"
    # restoring the same checkpoint again downloads nothing
    st3 = restore_subtask(storage, meta2, meta2.subtasks[0], tmp_path / "r3" / "db", cache)
    assert st3.downloaded_files == 0 and st3.cached_files == len(r2.handle.files)


def _overwrite(storage, rel, data):
    loc = storage.location
    path = loc.path(*rel.split("/"))
    if loc.is_local:
        os.chmod(path, 0o644)
    loc.fs.pipe_file(path, data)


def test_corrupt_file_is_named_and_nothing_is_restored(two_checkpoints, tmp_path):
    storage, r1, _ = two_checkpoints
    sst = max(r1.handle.files, key=lambda f: f.length)  # the data (a WAL or an SST)
    _overwrite(storage, sst.path, b"\x00" * sst.length)  # same length, wrong bytes
    meta = storage.read_metadata(1)
    with pytest.raises(CheckpointCorruptError, match=rf"file {sst.name} .* of checkpoint 1 of state 'clicks', "
                                                     rf"subtask 0 is corrupt: expected checksum {sst.checksum}"):
        restore_subtask(storage, meta, meta.subtasks[0], tmp_path / "r" / "db", LocalFileCache(tmp_path / "c"))
    assert not (tmp_path / "r" / "db").exists()
    assert [p for p in (tmp_path / "r").iterdir()] == []  # the staging dir is gone too
    assert LocalFileCache(tmp_path / "c").lookup(sst.checksum) is None


def test_truncated_file_is_corrupt(two_checkpoints, tmp_path):
    storage, r1, _ = two_checkpoints
    sst = max(r1.handle.files, key=lambda f: f.length)  # the data (a WAL or an SST)
    _overwrite(storage, sst.path, b"short")
    meta = storage.read_metadata(1)
    with pytest.raises(CheckpointCorruptError, match=rf"{sst.name}.*read 5 of {sst.length} bytes"):
        restore_subtask(storage, meta, meta.subtasks[0], tmp_path / "r" / "db", LocalFileCache(tmp_path / "c"))


def test_missing_file_is_named(two_checkpoints, tmp_path):
    storage, r1, _ = two_checkpoints
    sst = max(r1.handle.files, key=lambda f: f.length)  # the data (a WAL or an SST)
    storage.delete_files([sst.path])
    meta = storage.read_metadata(1)
    with pytest.raises(CheckpointNotFoundError, match=rf"file {sst.name} .* of checkpoint 1 of state 'clicks'.* "
                                                      r"is missing"):
        restore_subtask(storage, meta, meta.subtasks[0], tmp_path / "r" / "db", LocalFileCache(tmp_path / "c"))
    assert not (tmp_path / "r" / "db").exists()


def test_metadata_from_a_newer_version_is_refused(two_checkpoints):
    storage, _, _ = two_checkpoints
    doc = orjson.loads(storage.location.read_bytes(storage.metadata_path(2)))
    doc["version"] = 2
    storage.location.write_atomic(storage.metadata_path(2), orjson.dumps(doc))
    with pytest.raises(CheckpointCorruptError, match=r"chk-2/_metadata was written by a newer spark-steward "
                                                     r"\(metadata version 2.*upgrade"):
        storage.read_metadata(2)
    storage.location.write_atomic(storage.metadata_path(1), b'{"version": 1, "sta')
    with pytest.raises(CheckpointCorruptError, match="chk-1/_metadata is not valid JSON"):
        storage.read_metadata(1)


def test_restore_from_that_is_not_a_checkpoint(two_checkpoints):
    storage, r1, _ = two_checkpoints
    st, meta = open_checkpoint(storage.url_of("chk-1"))
    assert meta.checkpoint_id == 1 and st.url.rstrip("/") == storage.url.rstrip("/")
    st, meta = open_checkpoint(storage.url_of("chk-2/_metadata"))
    assert meta.checkpoint_id == 2
    with pytest.raises(CheckpointNotFoundError, match=r"restore_from='.*/shared' is not a checkpoint: "
                                                      r".*shared/_metadata does not exist"):
        open_checkpoint(storage.url_of("shared"))
    with pytest.raises(CheckpointNotFoundError, match=r"checkpoint 7 of state 'clicks' has no"):
        storage.read_metadata(7)


def test_records_validate(tmp_path):
    f = FileHandle(name="000012.sst", path="shared/" + "a" * 32, length=10, checksum="a" * 32)
    cur = FileHandle(name="CURRENT", path="shared/" + "b" * 32, length=16, checksum="b" * 32)
    with pytest.raises(InvalidRecordError, match="must be relative to the checkpoint root"):
        FileHandle(name="x", path="../../etc/passwd", length=1, checksum="a" * 32)
    with pytest.raises(InvalidRecordError, match="not a plain file name"):
        FileHandle(name="a/b", path="shared/x", length=1, checksum="a" * 32)
    with pytest.raises(InvalidRecordError, match="no CURRENT"):
        SubtaskHandle(0, KeyGroupRange(0, 4), (f,))
    h0 = SubtaskHandle(0, KeyGroupRange(0, 4), (f, cur))
    with pytest.raises(InvalidRecordError, match="do not tile"):
        CheckpointMetadata("s", 1, 2, 8, (h0, SubtaskHandle(1, KeyGroupRange(5, 8), ())))
    with pytest.raises(InvalidRecordError, match="one handle per subtask"):
        CheckpointMetadata("s", 1, 2, 8, (h0,))
    meta = CheckpointMetadata("s", 1, 2, 8, (h0, SubtaskHandle(1, KeyGroupRange(4, 8), ())))
    assert CheckpointMetadata.from_bytes(meta.to_bytes(), "x") == meta


def test_cache_evicts_least_recently_used_beyond_its_limit(two_checkpoints, tmp_path):
    storage, r1, r2 = two_checkpoints
    meta1 = storage.read_metadata(1)
    limit = 200_000
    cache = LocalFileCache(tmp_path / "cache", max_bytes=limit)
    restore_subtask(storage, meta1, meta1.subtasks[0], tmp_path / "r1" / "db", cache)
    assert cache.size <= max(limit, max(f.length for f in r1.handle.files))
    with RocksDBStateBackend(tmp_path / "r1", ALL, M, create=False) as b:  # the DB kept its own links
        assert sum(1 for _ in b.iter_raw()) == N_KEYS
    (tmp_path / "cache" / ".x.tmp").write_bytes(b"partial")
    again = LocalFileCache(tmp_path / "cache", max_bytes=limit)  # restart: leftovers go, sizes are rebuilt
    assert not (tmp_path / "cache" / ".x.tmp").exists() and again.size == cache.size


def test_a_listing_does_not_hide_files_another_process_writes_later(store_url, tmp_path, request):
    """Listing shared/ (the coordinator's start-up sweep, state.info, gc) must not leave a cached
    listing behind: on s3fs a cached parent listing makes open() of a file written afterwards by
    another process (an executor agent's upload) fail with FileNotFoundError."""
    storage = CheckpointStorage.open(store_url, "clicks", "cluster-a")
    a, b = "shared/" + "a" * 32, "shared/" + "b" * 32
    (tmp_path / "f").write_bytes(b"first")
    storage.put_file(tmp_path / "f", a)
    assert storage.shared_files() == {a}
    target = storage.location.path(*b.split("/"))
    if storage.location.is_local:
        with open(target, "wb") as f:
            f.write(b"second")
    else:   # another client, as in another process
        request.getfixturevalue("s3").filesystem().pipe_file(target, b"second")
    loc, path = storage.location_of(b)
    with loc.fs.open(path, "rb") as f:
        assert f.read() == b"second"
    assert storage.shared_files() == {a, b}
