"""Restores and savepoints touch only what they may: a savepoint target never overlaps a checkpoint
dir, a failed copy deletes only what it created, a restored record names only its state's data files
(or files its state claimed, read only under roots the caller names), every duplicated segment is verified, CLAIM takes over only files under
the source's root, and `gc --min-age` does not take a hard link's old mtime for its age. On file://
and moto S3."""

from __future__ import annotations

import os
import posixpath
import re
import time
import uuid
from dataclasses import replace

import pytest
from sparksteward.checkpoint.cli import find_orphans
from sparksteward.checkpoint.coordination.coordinator import CheckpointCoordinator
from sparksteward.checkpoint.coordination.driver_service import StateService
from sparksteward.checkpoint.duplicate import Duplicator
from sparksteward.checkpoint.records import CheckpointMetadata, FileHandle
from sparksteward.checkpoint.restore import restore_from, write_savepoint
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.cli import main
from sparksteward.errors import CheckpointCorruptError, CheckpointError, StorageError
from sparksteward.storage import open_location
from sparksteward.wire import AgentServer, Connection, new_secret

from tests.helpers.checkpoint import BATCHES, FailingHalfway, M, P, expected_counts, run_batch, stored_counts

pytestmark = pytest.mark.usefixtures("deletes_stay_in_tmp_path")


def _url(path: str) -> str:
    return path if "://" in path else "file://" + path


def _under(url: str, root: str) -> bool:
    def norm(u: str) -> str:
        return os.path.realpath(u.split("://", 1)[-1]) if "://" not in u or u.startswith("file://") else u

    return norm(url).startswith(norm(root).rstrip("/") + "/")


def _listing(storage: CheckpointStorage) -> dict[str, int]:
    fs, root = storage.location.fs, storage.location.root
    return {p: info["size"] for p, info in fs.find(root, detail=True).items()}


def _bytes(storage: CheckpointStorage, f: FileHandle) -> bytes:
    loc, path = storage.location_of(f.path)
    return loc.read_bytes(path)


def _forge(src: CheckpointStorage, meta, cid: int, change) -> str:
    """Write ``meta`` as ``chk-<cid>`` of ``src`` with subtask 0's files passed through ``change``."""
    s0 = meta.subtasks[0]
    forged = replace(meta, checkpoint_id=cid, subtasks=(replace(s0, files=tuple(change(s0.files))),
                                                        *meta.subtasks[1:]))
    src.write_metadata(forged)
    return src.url_of(f"chk-{cid}")


def _assert_nothing_restored(dst: CheckpointStorage) -> None:
    assert not dst.has_restored() and dst.stored_files() == set()


# --- savepoint targets ------------------------------------------------------------------------
def test_a_savepoint_overlapping_a_checkpoint_dir_is_refused_before_anything_is_written(tmp_path, store_url, source):
    src, meta = source
    before = _listing(src)
    cluster = posixpath.dirname(src.url.rstrip("/"))
    targets = {
        "the state's own root (on S3 a CopyObject onto itself)": src.url,
        "a directory under the state root": src.url_of("sp"),
        "the cluster dir": cluster,
        "the checkpoint dir": store_url,
        "a path under the checkpoint dir": store_url.rstrip("/") + "/savepoints/sp",
        "another state's root": CheckpointStorage.open(store_url, "other").url,
        "a parent of the checkpoint dir": posixpath.dirname(store_url.rstrip("/")),
    }
    for what, url in targets.items():
        with pytest.raises(CheckpointError, match=r"savepoint '.*' overlaps .* nothing was written. Pick a path "
                                                  r"outside every checkpoint dir"):
            write_savepoint(src, meta, url)
        assert _listing(src) == before, f"a savepoint into {what} changed the state's files"
    assert src.read_metadata(1) == meta
    assert stored_counts(src, meta, tmp_path, "a1") == expected_counts(BATCHES[:2])
    elsewhere = store_url.rstrip("/") + "-savepoints/sp"
    write_savepoint(src, meta, elsewhere)  # next to the checkpoint dir: fine
    assert open_location(elsewhere).exists(open_location(elsewhere).path("_metadata"))


def test_a_savepoint_named_like_a_checkpoint_is_refused(tmp_path, store_url, source):
    """restore_from reads a URL ending in chk-<N> (or _metadata) as a retained checkpoint and resolves
    its files against the parent: a savepoint there could never be restored, so none is written."""
    src, meta = source
    for last in ("chk-0", "chk-17", "_metadata"):
        url = store_url.rstrip("/") + f"-savepoints/{last}"
        with pytest.raises(CheckpointError, match=rf"ends in '{last}', which restore_from reads as a checkpoint"):
            write_savepoint(src, meta, url)
        assert not open_location(url).exists(open_location(url).root)
    url = store_url.rstrip("/") + "-savepoints/chk-0-copy"   # only the exact names
    dst = CheckpointStorage.open(store_url, "from-chk-0-copy")
    restored = restore_from(write_savepoint(src, meta, url), dst, max_parallelism=M)
    assert stored_counts(dst, restored, tmp_path, "named") == expected_counts(BATCHES[:2])


def test_a_failed_savepoint_deletes_only_the_files_it_created(store_url, source):
    src, meta = source
    url = store_url.rstrip("/") + "-savepoints/sp-mixed"
    loc = open_location(url)
    keep = meta.subtasks[0].files[0]   # already at the target before the call: not the call's to delete
    loc.write_atomic(loc.path("shared", keep.checksum), _bytes(src, keep))
    with pytest.raises(StorageError, match="injected"):
        write_savepoint(src, meta, url, FailingHalfway())
    left = {posixpath.basename(p) for p in loc.fs.find(loc.root)}
    assert left == {keep.checksum}


def test_duplicating_a_file_onto_itself_is_refused_before_anything_is_copied(tmp_path, store_url, source):
    src, meta = source
    before = _listing(src)
    f = meta.subtasks[0].files[0]
    here = src.url_of(f.path)
    fresh = _url(store_url.rstrip("/") + "-copies/x")
    pairs = [(here, fresh), (here, here)]
    if "://" not in store_url:  # the same file through a symlinked directory is the same place too
        os.symlink(src.location.root, tmp_path / "alias")
        pairs.append((here, str(tmp_path / "alias" / f.path)))
    for pair in pairs[1:]:
        with pytest.raises(CheckpointError, match=r"cannot duplicate .* onto itself .* nothing was copied"):
            Duplicator().duplicate([pairs[0], pair])
    loc = open_location(fresh)
    assert not loc.exists(loc.root)
    assert _listing(src) == before
    assert stored_counts(src, meta, tmp_path, "a1") == expected_counts(BATCHES[:2])


def test_the_service_refuses_a_savepoint_in_any_checkpoint_dir_it_knows(tmp_path):
    chk, other = str(tmp_path / "chk"), str(tmp_path / "other-chk")
    storage = CheckpointStorage.open(chk, "a", "c1")
    coord = CheckpointCoordinator(storage, P, M)
    run_batch(coord, storage, tmp_path / "a", 0, BATCHES[0])
    coord.complete(0)
    secret = new_secret()
    server = AgentServer("127.0.0.1", 0, secret, {})
    StateService(chk, "c1", commit_timeout=30).register_handlers(server)
    conn = Connection.connect(server.endpoint, secret)
    try:
        conn.request("state.register", name="x", checkpoint_dir=other, parallelism=P, max_parallelism=M,
                     key_type="string", num_retained=1)
        for url in (os.path.join(other, "sp"), os.path.join(chk, "sp"), str(tmp_path)):
            with pytest.raises(CheckpointError, match="overlaps"):
                conn.request("state.savepoint", name="a", url=url, checkpoint_dir=None)
        assert not os.path.exists(os.path.join(other, "sp"))
        saved = conn.request("state.savepoint", name="a", url=str(tmp_path / "savepoints" / "a"), checkpoint_dir=None)
        assert saved["checkpoint_id"] == 0
    finally:
        conn.close()
        server.close()


# --- restored records -------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["no_claim", "claim"])
@pytest.mark.parametrize("forgery", ["outside", "not a data file", "mislabelled"])
def test_a_record_naming_anything_but_its_data_files_is_refused_by_name(tmp_path, store_url, source, mode, forgery):
    src, meta = source
    f0, f1 = meta.subtasks[0].files[:2]
    outside = open_location(store_url.rstrip("/") + f"-outside-{uuid.uuid4().hex[:6]}")
    outside.write_atomic(outside.path("shared", f0.checksum), _bytes(src, f0))  # shaped like a data file
    outside_url = _url(outside.display(outside.path("shared", f0.checksum)))
    record = src.read_metadata(0).to_bytes()
    named = {
        "outside": (replace(f0, path=outside_url), "lies outside the source's state root"),
        "not a data file": (FileHandle(f0.name, "chk-0/_metadata", len(record), _xxh(record)), "is not a data file"),
        "mislabelled": (replace(f1, name=f0.name, checksum=f0.checksum, length=f1.length), "is not a data file"),
    }
    bad, reason = named[forgery]
    url = _forge(src, meta, 7, lambda files: (bad, *files[1:]))
    dst = CheckpointStorage.open(store_url, f"d-{mode}")
    with pytest.raises(CheckpointError, match=rf"restore_from=.*chk-7.*: file {f0.name} of subtask 0 "
                                              rf"\({re.escape(bad.path)}\) {reason}.*nothing was written"):
        restore_from(url, dst, max_parallelism=M, claim_mode=mode)
    _assert_nothing_restored(dst)
    assert outside.read_bytes(outside.path("shared", f0.checksum)) == _bytes(src, f0)
    assert src.read_metadata(0).to_bytes() == record


@pytest.mark.parametrize("mode", ["no_claim", "claim"])
def test_a_claim_of_another_states_files_is_honoured_only_under_a_root_the_caller_names(tmp_path, store_url, source,
                                                                                       mode):
    """A hand-made savepoint lists a file of another tenant's state as claimed: restore_from would copy it
    into this state with the agent's credentials. It is refused by name unless the caller names that
    state's root, and then restores exactly."""
    src, meta = source
    f0 = meta.subtasks[0].files[0]
    tenant = CheckpointStorage.open(store_url.rstrip("/") + "-tenant-b", "secret")
    tenant.location.write_atomic(tenant.location.path("shared", f0.checksum), _bytes(src, f0))
    theirs = _url(tenant.location.display(tenant.location.path("shared", f0.checksum)))
    sp = store_url.rstrip("/") + f"-savepoints/forged-{mode}"
    write_savepoint(src, meta, sp)
    sp_loc = open_location(sp)
    record = CheckpointMetadata.from_bytes(sp_loc.read_bytes(sp_loc.path("_metadata")), sp)
    s0 = record.subtasks[0]
    forged = replace(record, subtasks=(replace(s0, files=(replace(s0.files[0], path=theirs), *s0.files[1:])),
                                       *record.subtasks[1:]), properties={**record.properties, "claimed": [theirs]})
    sp_loc.write_atomic(sp_loc.path("_metadata"), forged.to_bytes())
    sp_loc.delete(sp_loc.path("shared", f0.checksum))   # the bytes are only in the other tenant's state

    dst = CheckpointStorage.open(store_url, f"d-{mode}")
    with pytest.raises(CheckpointError, match=rf"file {f0.name} of subtask 0 \({re.escape(theirs)}\) lies outside "
                                              rf"the source's state root.*nothing was written.*"
                                              rf"claimed_roots=\[{re.escape(repr(theirs.rsplit('/', 2)[0]))}\]"):
        restore_from(sp, dst, max_parallelism=M, claim_mode=mode)
    _assert_nothing_restored(dst)
    assert tenant.location.read_bytes(tenant.location.path("shared", f0.checksum)) == _bytes(src, f0)
    with pytest.raises(CheckpointError, match="lies outside the source's state root"):   # another root named
        restore_from(sp, dst, max_parallelism=M, claim_mode=mode, claimed_roots=[src.url])
    _assert_nothing_restored(dst)

    restored = restore_from(sp, dst, max_parallelism=M, claim_mode=mode, claimed_roots=[tenant.url])
    assert theirs not in {f.path for f in restored.files()}   # copied (CLAIM too), never taken over
    assert stored_counts(dst, restored, tmp_path, f"t-{mode}") == expected_counts(BATCHES[:2])
    assert tenant.location.read_bytes(tenant.location.path("shared", f0.checksum)) == _bytes(src, f0)


def _xxh(data: bytes) -> str:
    from sparksteward.hashing import Hasher

    h = Hasher()
    h.update(data)
    return h.digest().hex()


@pytest.mark.parametrize("store_url", ["file"], indirect=True)  # the same check as restore_from's
def test_state_check_refuses_a_record_naming_a_file_outside_its_root(tmp_path, store_url, source):
    src, meta = source
    f0 = meta.subtasks[0].files[0]
    stray = tmp_path / "stray" / "shared" / f0.checksum
    stray.parent.mkdir(parents=True)
    stray.write_bytes(_bytes(src, f0))
    url = _forge(src, meta, 7, lambda files: (replace(files[0], path=_url(str(stray))), *files[1:]))
    secret = new_secret()
    server = AgentServer("127.0.0.1", 0, secret, {})
    StateService(str(tmp_path / "chk2"), "default", commit_timeout=30).register_handlers(server)
    conn = Connection.connect(server.endpoint, secret)
    try:
        with pytest.raises(CheckpointError, match=r"lies outside the source's state root"):
            conn.request("state.check", name="b", checkpoint_dir=None, max_parallelism=M, restore_from=url)
    finally:
        conn.close()
        server.close()


def _merge_two(src: CheckpointStorage, meta, cid: int, *, flip: bool = False) -> str:
    """Forge ``chk-<cid>``: subtask 0's first two files as segments of one merged physical file."""
    f0, f1 = meta.subtasks[0].files[:2]
    a, b = _bytes(src, f0), _bytes(src, f1)
    rel = f"merged/{uuid.uuid4().hex}"
    data = a + (bytes([b[0] ^ 0xFF]) + b[1:] if flip else b)
    src.location.write_atomic(src.location.path(*rel.split("/")), data)
    return _forge(src, meta, cid, lambda files: (replace(f0, path=rel), replace(f1, path=rel, offset=len(a)),
                                                 *files[2:]))


def test_duplicated_segments_are_verified_against_their_checksums(tmp_path, store_url, source):
    src, meta = source
    good = _merge_two(src, meta, 7)
    dst = CheckpointStorage.open(store_url, "good")
    restored = restore_from(good, dst, max_parallelism=M)
    assert any(f.is_segment for f in restored.files()) and dst.merged_files()
    assert stored_counts(dst, restored, tmp_path, "good") == expected_counts(BATCHES[:2])

    bad = _merge_two(src, meta, 8, flip=True)   # the second segment's first byte changed, its size not
    f1 = meta.subtasks[0].files[1]
    for mode in ("no_claim", "claim"):
        dst = CheckpointStorage.open(store_url, f"bad-{mode}")
        if mode == "claim":  # nothing is duplicated: the executors verify the bytes they read
            restored = restore_from(bad, dst, max_parallelism=M, claim_mode=mode)
            with pytest.raises(CheckpointCorruptError, match=rf"file {f1.name} .* is corrupt: expected checksum"):
                stored_counts(dst, restored, tmp_path / "fresh-cache", "bad-claim")
            continue
        with pytest.raises(CheckpointCorruptError, match=rf"restore_from=.*chk-8.*: file {f1.name} \(merged/.*, "
                                                         rf"{f1.length} bytes at offset .*\) does not match its "
                                                         rf"checksum {f1.checksum}; nothing was restored"):
            restore_from(bad, dst, max_parallelism=M, claim_mode=mode)
        _assert_nothing_restored(dst)


def test_claim_takes_over_only_files_under_the_source_root(tmp_path, store_url, source):
    src, meta = source
    b = CheckpointStorage.open(store_url, "b")
    restore_from(src.url_of("chk-1"), b, max_parallelism=M, claim_mode="claim")
    coord = CheckpointCoordinator(b, P, M)
    run_batch(coord, b, tmp_path / "b", 0, BATCHES[2])
    chk0 = coord.complete(0)
    from_a = set(chk0.properties["claimed"])   # b's chk-0 still names files it claimed from a
    assert from_a and all(_under(p, src.url) for p in from_a)
    expected = expected_counts(BATCHES[:3])

    c = CheckpointStorage.open(store_url, "c")   # NO_CLAIM: files a claimed by b are copied like the rest
    with pytest.raises(CheckpointError, match=r"which the record says its state claimed.*pass claimed_roots="):
        restore_from(b.url_of("chk-0"), c, max_parallelism=M)   # ... from a root the caller names
    _assert_nothing_restored(c)
    restored = restore_from(b.url_of("chk-0"), c, max_parallelism=M, claimed_roots=[src.url])
    assert all(f.is_relative for f in restored.files())
    assert stored_counts(c, restored, tmp_path, "c") == expected

    d = CheckpointStorage.open(store_url, "d")   # CLAIM: only b's own files are taken over
    restored = restore_from(b.url_of("chk-0"), d, max_parallelism=M, claim_mode="claim", claimed_roots=[src.url])
    absolute = {f.path for f in restored.files() if not f.is_relative}
    assert absolute and all(_under(p, b.url) for p in absolute)
    assert {f.checksum for f in restored.files() if f.is_relative} == {p.rsplit("/", 1)[1] for p in from_a}
    assert CheckpointCoordinator(d, P, M).claimed() == absolute
    assert stored_counts(d, restored, tmp_path, "d") == expected


# --- gc ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("store_url", ["file"], indirect=True)  # hard links: local stores only
def test_gc_does_not_take_a_hard_linked_files_old_mtime_for_its_age(tmp_path, store_url, source, capsys):
    src, meta = source
    old = time.time() - 7200
    for p in src.shared_files():   # the source's files were written two hours ago
        os.utime(src.location.path(*p.split("/")), (old, old))

    class GcWhileRestoring(Duplicator):
        def duplicate(self, pairs):
            super().duplicate(pairs)   # linked, not yet referenced by restored/_metadata
            assert main(["checkpoints", "gc", store_url, "b", "--min-age", "1h"]) == 0

    dst = CheckpointStorage.open(store_url, "b")
    dup = GcWhileRestoring()
    restored = restore_from(src.url_of("chk-1"), dst, max_parallelism=M, duplicator=dup)
    assert dup.stats.linked and "deleted 0 orphaned" in capsys.readouterr().out
    assert {f.path for f in restored.files()} <= dst.shared_files()
    assert stored_counts(dst, restored, tmp_path, "b") == expected_counts(BATCHES[:2])

    dst.delete_checkpoint_dir(-1)   # now unreferenced: they are orphans, aged from their link
    assert find_orphans(dst, 3600, time.time()) == []
    assert find_orphans(dst, 3600, time.time() + 7200) == sorted(dst.shared_files())
