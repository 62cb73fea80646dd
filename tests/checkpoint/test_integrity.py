"""A checkpoint completes only on files that are in the store (issue 35 item 1), on file:// and moto
S3: whoever deleted an acked upload (an offline tool, an operator, another writer), ``complete`` finds
it before ``_metadata`` names it, with one check per file the retained checkpoints do not hold."""

from __future__ import annotations

import pytest
from sparksteward.checkpoint.coordination.coordinator import CheckpointCoordinator
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.errors import CheckpointError

from tests.helpers.checkpoint import BATCHES, M, P, expected_counts, run_batch, stored_counts


def test_a_checkpoint_never_completes_on_an_upload_someone_else_deleted(tmp_path, store_url):
    storage = CheckpointStorage.open(store_url, "verified")
    coord = CheckpointCoordinator(storage, P, M)
    run_batch(coord, storage, tmp_path, 0, BATCHES[0])
    held = coord.complete(0).physical_paths()

    _, results = run_batch(coord, storage, tmp_path, 1, BATCHES[1])
    new = sorted({p for r in results for p in r.uploaded} - held)
    assert new, "batch 1 uploaded nothing new"
    victim = new[0]
    storage.location.delete(storage.location.path(*victim.split("/")))   # e.g. a gc run beside the writer
    with pytest.raises(CheckpointError, match=rf"cannot complete: it references \['{victim}'\]"):
        coord.complete(1)
    assert storage.checkpoint_ids() == [0], "no record names the deleted file"

    coord.abort(1)
    run_batch(coord, storage, tmp_path, 1, BATCHES[1], attempt="b")
    meta = coord.complete(1)
    assert stored_counts(storage, meta, tmp_path, "1") == expected_counts(BATCHES[:2])


def test_the_check_looks_only_at_files_no_retained_checkpoint_holds(tmp_path, store_url):
    storage = CheckpointStorage.open(store_url, "checked")
    coord = CheckpointCoordinator(storage, P, M)
    run_batch(coord, storage, tmp_path, 0, BATCHES[0])
    coord.complete(0)
    _, results = run_batch(coord, storage, tmp_path, 1, BATCHES[1])
    asked: list[list[str]] = []
    real = storage.missing

    def counting(paths, list_above=8):
        paths = sorted(paths)
        asked.append(paths)
        return real(paths, list_above)

    storage.missing = counting
    meta = coord.complete(1)
    uploaded = {p for r in results for p in r.uploaded}
    assert asked == [sorted(uploaded)], (asked, uploaded)
    assert set(asked[0]) < meta.physical_paths(), "reused files were checked again"
