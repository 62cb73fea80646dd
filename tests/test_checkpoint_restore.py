"""restore_from another state's checkpoint: NO_CLAIM by fast duplication (0 bytes through the process),
CLAIM without copying, savepoints, and the errors for bad sources; on file:// and moto S3."""

from __future__ import annotations

import pytest

from sparksteward.checkpoint.coordinator import CheckpointCoordinator
from sparksteward.checkpoint.duplicate import Duplicator
from sparksteward.checkpoint.restore import restore_from, write_savepoint
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.errors import CheckpointError, CheckpointNotFoundError, ParallelismError

from tests.state_helpers import _s3_server, store_url  # noqa: F401 - fixtures
from tests.test_checkpoint_coordinator import BATCHES, M, P, _counts, _expected, _run_batch


@pytest.fixture
def source(tmp_path, store_url):
    """State 'a' with checkpoints 0 and 1 completed."""
    storage = CheckpointStorage.open(store_url, "a")
    coord = CheckpointCoordinator(storage, P, M)
    for n in range(2):
        _run_batch(coord, storage, tmp_path / "a", n, BATCHES[n])
        coord.complete(n)
    return storage, coord.completed(1)


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
    begun, results = _run_batch(coord, dst, tmp_path / "b", 0, BATCHES[2])
    assert begun.base == restored
    restored_sums = {f.checksum for f in restored.files()}
    uploaded = {p.split("/")[-1] for r in results for p in r.uploaded}
    assert not uploaded & restored_sums  # the restored files are never uploaded again
    coord.complete(0)
    assert _counts(dst, coord.completed(0), tmp_path, "b0") == _expected(BATCHES[:3])

    _run_batch(coord, dst, tmp_path / "b", 1, BATCHES[3])  # the restored starting point can go now
    assert coord.restored is None and not dst.has_restored()
    assert src.shared_files() == src_files  # NO_CLAIM: the source is untouched
    assert _counts(src, meta, tmp_path, "a1") == _expected(BATCHES[:2])


def test_claim_restore_copies_nothing(tmp_path, store_url, source):
    src, meta = source
    dst = CheckpointStorage.open(store_url, "c")
    dup = Duplicator()
    restored = restore_from(src.url_of("chk-1") + "/", dst, max_parallelism=M, claim_mode="claim", duplicator=dup)
    assert dup.stats == Duplicator().stats  # nothing copied, linked or streamed
    assert dst.shared_files() == set() and all("://" in f.path for f in restored.files())
    coord = CheckpointCoordinator(dst, P, M)
    _run_batch(coord, dst, tmp_path / "c", 0, BATCHES[2])
    coord.complete(0)
    assert _counts(dst, coord.completed(0), tmp_path, "c0") == _expected(BATCHES[:3])
    _run_batch(coord, dst, tmp_path / "c", 1, BATCHES[3])
    coord.complete(1)
    _run_batch(coord, dst, tmp_path / "c", 2, BATCHES[0])
    assert _counts(src, meta, tmp_path, "a1") == _expected(BATCHES[:2])  # claimed files are never deleted here


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
    assert _counts(dst, restored, tmp_path, "d") == _expected(BATCHES[:2])


def test_bad_restore_sources_are_refused_before_anything_is_written(store_url, source):
    src, meta = source
    dst = CheckpointStorage.open(store_url, "e")
    with pytest.raises(CheckpointNotFoundError, match=r"restore_from='.*/a/chk-9' is not a checkpoint"):
        restore_from(src.url_of("chk-9"), dst, max_parallelism=M)
    with pytest.raises(ParallelismError, match=r"max_parallelism=16 .* cannot be restored with max_parallelism=32"):
        restore_from(src.url_of("chk-1"), dst, max_parallelism=32)
    with pytest.raises(CheckpointError, match="claim_mode='steal' is not valid"):
        restore_from(src.url_of("chk-1"), dst, max_parallelism=M, claim_mode="steal")
    assert not dst.has_restored() and dst.shared_files() == set()
