"""restore_from another state's checkpoint: NO_CLAIM by fast duplication (0 bytes through the process),
CLAIM without copying, savepoints, and the errors for bad sources; on file:// and moto S3."""

from __future__ import annotations

import pytest
from sparksteward.checkpoint.coordination.coordinator import CheckpointCoordinator
from sparksteward.checkpoint.duplicate import Duplicator
from sparksteward.checkpoint.restore import restore_from, write_savepoint
from sparksteward.checkpoint.storage import CheckpointStorage, open_checkpoint
from sparksteward.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    ParallelismError,
    StateEncodingError,
    StorageError,
)
from sparksteward.storage import open_location

from tests.helpers.checkpoint import BATCHES, FailingHalfway, M, P, expected_counts, run_batch, stored_counts

pytestmark = pytest.mark.usefixtures("deletes_stay_in_tmp_path")


def test_no_claim_restore_duplicates_without_moving_bytes(tmp_path, store_url, source):
    src, meta = source
    src_files = src.shared_files()
    dst = CheckpointStorage.open(store_url, "b")
    dup = Duplicator()
    restored = restore_from(src.url_of("chk-1"), dst, max_parallelism=M, duplicator=dup)
    assert dup.bytes_streamed == 0
    assert dup.stats.linked + dup.stats.server_side == len({f.checksum for f in meta.files()})
    assert dst.shared_files() == {f.path for f in restored.files()}
    assert restored.properties["claim_mode"] == "no_claim" and restored.state == "b"

    coord = CheckpointCoordinator(dst, P, M)
    assert coord.restored is not None and coord.last_completed is None
    begun, results = run_batch(coord, dst, tmp_path / "b", 0, BATCHES[2])
    assert begun.base == restored
    restored_sums = {f.checksum for f in restored.files()}
    uploaded = {p.split("/")[-1] for r in results for p in r.uploaded}
    assert not uploaded & restored_sums  # the restored files are never uploaded again
    coord.complete(0)
    assert stored_counts(dst, coord.completed(0), tmp_path, "b0") == expected_counts(BATCHES[:3])

    run_batch(coord, dst, tmp_path / "b", 1, BATCHES[3])  # the restored starting point can go now
    assert coord.restored is None and not dst.has_restored()
    assert src.shared_files() == src_files  # NO_CLAIM: the source is untouched
    assert stored_counts(src, meta, tmp_path, "a1") == expected_counts(BATCHES[:2])


def test_claim_restore_copies_nothing_and_deletes_only_claimed_files_once_subsumed(tmp_path, store_url, source):
    src, meta = source
    assert src.checkpoint_ids() == [0, 1]  # chk-0 is kept as the base of chk-1: outside the claimed checkpoint
    before = src.shared_files()
    chk0 = src.read_metadata(0)
    claimed = {src.url_of(f.path) for f in meta.files()}
    only_chk0 = {f.path for f in chk0.files()} - {f.path for f in meta.files()}
    assert only_chk0, "the test needs source files outside the claimed checkpoint"
    dst = CheckpointStorage.open(store_url, "c")
    dup = Duplicator()
    restored = restore_from(src.url_of("chk-1") + "/", dst, max_parallelism=M, claim_mode="claim", duplicator=dup)
    assert dup.stats == Duplicator().stats  # nothing copied, linked or streamed
    assert dst.shared_files() == set() and all("://" in f.path for f in restored.files())
    assert restored.properties["claimed_metadata"].endswith("/a/chk-1/_metadata")

    coord = CheckpointCoordinator(dst, P, M)
    assert {p.split("://", 1)[-1] for p in coord.claimed()} == {u.split("://", 1)[-1] for u in claimed}
    run_batch(coord, dst, tmp_path / "c", 0, BATCHES[2])
    coord.complete(0)
    assert stored_counts(dst, coord.completed(0), tmp_path, "c0") == expected_counts(BATCHES[:3])
    still = {f.path for f in coord.completed(0).files() if "://" in f.path}
    assert still and coord.completed(0).properties["claimed"] == sorted(still)
    assert src.read_metadata(1) == meta  # the restored record is still retained: nothing deleted yet

    run_batch(coord, dst, tmp_path / "c", 1, BATCHES[3])  # subsumes `restored`: the claimed record goes
    coord.complete(1)
    assert not dst.has_restored() and src.checkpoint_ids() == [0]
    run_batch(coord, dst, tmp_path / "c", 2, BATCHES[0])
    coord.complete(2)
    run_batch(coord, dst, tmp_path / "c", 3, BATCHES[1])
    coord.complete(3)
    assert stored_counts(dst, coord.completed(3), tmp_path, "c3") == expected_counts([*BATCHES[:4], BATCHES[0], BATCHES[1]])

    referenced = {f.path for c in coord.retained() for f in coord.completed(c).files()}
    left = src.shared_files()
    gone = before - left
    assert gone, "claimed files no retained checkpoint references are deleted"
    assert {src.url_of(p) for p in gone} <= claimed  # never a file outside the claimed checkpoint
    assert only_chk0 <= left and src.read_metadata(0) == chk0  # files outside the claimed checkpoint stay
    for p in referenced:
        if "://" in p:
            assert p.split("/")[-1] in {q.split("/")[-1] for q in left}  # still referenced: kept

    again = CheckpointCoordinator(dst, P, M)  # a restart knows what it owns from the records alone
    assert again.claimed() == {p for p in referenced if "://" in p}


def test_savepoint_is_self_contained(tmp_path, store_url, source):
    src, meta = source
    url = store_url.rstrip("/") + "-savepoints/sp-1"
    dup = Duplicator()
    written = write_savepoint(src, meta, url, dup)
    assert written.endswith("sp-1/_metadata") and dup.bytes_streamed == 0
    with pytest.raises(CheckpointError, match="already exists"):
        write_savepoint(src, meta, url)
    dst = CheckpointStorage.open(store_url, "d")
    restored = restore_from(url, dst, max_parallelism=M)
    assert stored_counts(dst, restored, tmp_path, "d") == expected_counts(BATCHES[:2])


def test_bad_restore_sources_are_refused_before_anything_is_written(store_url, source):
    src, meta = source
    dst = CheckpointStorage.open(store_url, "e")
    with pytest.raises(CheckpointNotFoundError, match=r"restore_from='.*/a/chk-9' is not a checkpoint"):
        restore_from(src.url_of("chk-9"), dst, max_parallelism=M)
    with pytest.raises(ParallelismError, match=r"Changing max_parallelism is refused: .*max_parallelism=16 .* "
                                               r"cannot be restored with max_parallelism=32"):
        restore_from(src.url_of("chk-1"), dst, max_parallelism=32)
    with pytest.raises(CheckpointError, match="claim_mode='steal' is not valid"):
        restore_from(src.url_of("chk-1"), dst, max_parallelism=M, claim_mode="steal")
    assert not dst.has_restored() and dst.shared_files() == set()
    with pytest.raises(StateEncodingError, match=r"restore_from=.* holds string keys, but state 'e' has long keys"):
        restore_from(src.url_of("chk-1"), dst, max_parallelism=M, key_type="long")
    sp = open_location(dst.url_of("sp"))  # a savepoint copied there by hand (write_savepoint refuses it)
    sp.write_atomic(sp.path("_metadata"), meta.to_bytes())
    with pytest.raises(CheckpointError, match=r"restore_from='.*/e/sp' is inside the directory of state 'e'"):
        restore_from(dst.url_of("sp"), dst, max_parallelism=M)
    assert not dst.has_restored() and dst.shared_files() == set()


def _shared_loc(storage, rel):
    return storage.location, storage.location.path(*rel.split("/"))


@pytest.mark.parametrize("mode", ["no_claim", "claim"])
def test_missing_or_truncated_source_files_are_refused_before_anything_is_written(store_url, source, mode):
    src, meta = source
    dst = CheckpointStorage.open(store_url, f"m-{mode}")
    victim = meta.subtasks[1].files[0]
    loc, path = _shared_loc(src, victim.path)
    data = loc.read_bytes(path)
    loc.write_atomic(path, data[: len(data) // 2])
    with pytest.raises(CheckpointCorruptError, match=rf"restore_from='.*chk-1': file {victim.name} of subtask 1 "
                                                     rf"\(.*{victim.checksum}\) is corrupt: it has {len(data) // 2} "
                                                     rf"bytes, its record says {len(data)}; nothing was restored"):
        restore_from(src.url_of("chk-1"), dst, max_parallelism=M, claim_mode=mode)
    loc.delete(path)
    with pytest.raises(CheckpointNotFoundError, match=rf"file {victim.name} of subtask 1 .* is missing, so the "
                                                      rf"checkpoint is incomplete.*nothing was restored. Pass "
                                                      rf"another retained checkpoint or a savepoint"):
        restore_from(src.url_of("chk-1"), dst, max_parallelism=M, claim_mode=mode)
    assert not dst.has_restored() and dst.shared_files() == set()


def test_a_newer_version_is_refused_naming_the_file(store_url, source):
    import orjson

    src, meta = source
    doc = orjson.loads(meta.to_bytes())
    doc["version"] = 99
    src.location.write_atomic(src.metadata_path(1), orjson.dumps(doc))
    dst = CheckpointStorage.open(store_url, "v")
    with pytest.raises(CheckpointCorruptError, match=r"chk-1/_metadata was written by a newer spark-steward "
                                                     r"\(metadata version 99; .*\): upgrade spark-steward"):
        restore_from(src.url_of("chk-1"), dst, max_parallelism=M)
    assert not dst.has_restored() and dst.shared_files() == set()


def test_a_failed_duplication_leaves_nothing_behind(tmp_path, store_url, source):
    src, meta = source
    dst = CheckpointStorage.open(store_url, "f")
    with pytest.raises(StorageError, match="injected"):
        restore_from(src.url_of("chk-1"), dst, max_parallelism=M, duplicator=FailingHalfway())
    assert not dst.has_restored() and dst.shared_files() == set()
    url = store_url.rstrip("/") + "-savepoints/sp-f"
    with pytest.raises(StorageError, match="injected"):
        write_savepoint(src, meta, url, FailingHalfway())
    loc = open_location(url)
    assert not loc.fs.exists(loc.root) or not loc.fs.find(loc.root)
    write_savepoint(src, meta, url)  # and the same url works afterwards
    saved, saved_meta = open_checkpoint(url)
    assert stored_counts(saved, saved_meta, tmp_path, "spf") == expected_counts(BATCHES[:2])


def test_restore_into_a_state_with_checkpoints_is_refused_and_a_new_source_replaces_the_old(
        tmp_path, store_url, source):
    src, meta = source
    with pytest.raises(CheckpointError, match=r"state 'a' .* already has checkpoints \[0, 1\] of its own"):
        restore_from(store_url + "/elsewhere/chk-3", src, max_parallelism=M)
    dst = CheckpointStorage.open(store_url, "r")
    restore_from(src.url_of("chk-1"), dst, max_parallelism=M, claim_mode="claim")
    restore_from(src.url_of("chk-0"), dst, max_parallelism=M)  # before any checkpoint: replaces it
    restored = dst.read_metadata(-1)
    assert restored.properties["restored_from"].endswith("chk-0") and restored.properties["claim_mode"] == "no_claim"
    assert stored_counts(dst, restored, tmp_path, "r") == expected_counts(BATCHES[:1])


def test_a_pinned_checkpoint_outlives_subsumption_until_unpinned(tmp_path, store_url, source):
    src, meta = source
    coord = CheckpointCoordinator(src, P, M)
    assert coord.pin(1) == meta
    for n in (2, 3):
        run_batch(coord, src, tmp_path / "p", n, BATCHES[n])
        coord.complete(n)
    assert 1 in coord.retained() and src.read_metadata(1) == meta
    assert stored_counts(src, meta, tmp_path, "pinned") == expected_counts(BATCHES[:2])  # its files are all there
    coord.unpin(1)
    assert 1 not in coord.retained() and 1 not in src.checkpoint_ids()
