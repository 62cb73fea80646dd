"""remove_state on file:// and moto S3: refused while a real writer lease is live, records before data
files, files another state claimed kept, nothing outside the state's root touched."""

from __future__ import annotations

import os
import time

import pytest
from sparksteward.checkpoint.coordination.coordinator import CheckpointCoordinator
from sparksteward.checkpoint.lease import LEASE_FILE, StateLease, read_lease
from sparksteward.checkpoint.removal import collect_garbage, remove_state
from sparksteward.checkpoint.restore import restore_from
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.errors import CheckpointError, CheckpointNotFoundError, InvalidIdError, StateLeaseError, StorageError
from sparksteward.owner import OwnerRecord
from sparksteward.storage import open_location
from sparksteward.testing.clock import FakeClock

from tests.helpers.checkpoint import BATCHES, M, P, expected_counts, run_batch, stored_counts

pytestmark = pytest.mark.usefixtures("deletes_stay_in_tmp_path")

ELSEWHERE = OwnerRecord("other-host", "boot", 4242, 1.0, "pid:[1]")


def _objects(storage: CheckpointStorage) -> list[str]:
    """Every file under the state root, relative to it."""
    loc = storage.location
    return sorted(p[len(loc.root) + 1:] for p in loc.fs.find(loc.root))


def _gone(storage: CheckpointStorage) -> bool:
    loc = storage.location
    return not os.path.exists(loc.root) if loc.is_local else not loc.fs.find(loc.root)


def test_a_live_writer_is_refused_and_a_released_one_is_not(store_url, source):
    src, _ = source
    lease = StateLease(src.location, "a", application="app-live", ttl=60)
    lease.acquire()   # this process, on this host: live
    before = _objects(src)
    with pytest.raises(StateLeaseError, match=r"not deleting state 'a'.*application app-live.*Stop that application"):
        remove_state(store_url, "a")
    with pytest.raises(StateLeaseError, match="app-live"):
        remove_state(store_url, "a", dry_run=True)
    assert _objects(src) == before
    lease.release()
    out = remove_state(store_url, "a")
    assert out.removed and out.records == ["chk-0", "chk-1"] and out.deleted == len(out.files) > 0
    assert _gone(src)
    with pytest.raises(CheckpointNotFoundError, match="no state 'a' of cluster id 'default'"):
        remove_state(store_url, "a")


def test_a_silent_holder_on_another_host_is_watched_then_taken_over(store_url, source):
    src, _ = source
    StateLease(src.location, "a", application="app-gone", ttl=0.2, owner=ELSEWHERE,
               wall=lambda: time.time() - 100).acquire()
    notes: list[str] = []
    out = remove_state(store_url, "a", notice=notes.append)
    assert out.removed and _gone(src)
    assert len(notes) == 1 and "watching it for 0.2 s" in notes[0] and "app-gone" in notes[0]


def test_records_go_before_data_files_and_a_second_rm_finishes(store_url, source, monkeypatch):
    src, _ = source
    data = src.stored_files()

    def crash(self, paths):
        raise StorageError("the store went away")

    monkeypatch.setattr(CheckpointStorage, "delete_files", crash)
    with pytest.raises(StorageError):
        remove_state(store_url, "a")
    assert src.checkpoint_ids() == [] and not src.has_restored()   # nothing restorable is left ...
    assert src.stored_files() == data                              # ... before any data file went
    assert read_lease(src.location) is not None and read_lease(src.location).released
    monkeypatch.undo()
    out = remove_state(store_url, "a")
    assert out.records == [] and out.deleted == len(data) and out.removed and _gone(src)


def test_files_another_state_claimed_stay_until_it_is_removed(tmp_path, store_url, source):
    src, meta = source
    dst = CheckpointStorage.open(store_url, "c")
    restore_from(src.url_of("chk-1"), dst, max_parallelism=M, claim_mode="claim")
    claimed = {f.path for f in meta.files()}
    out = remove_state(store_url, "a")
    assert set(out.kept) == claimed and all(v == ["default/c"] for v in out.kept.values())
    assert not out.removed and src.stored_files() == claimed and src.checkpoint_ids() == []
    assert read_lease(src.location).released
    coord = CheckpointCoordinator(dst, P, M)   # c still restores from what a claimed
    run_batch(coord, dst, tmp_path / "c", 0, BATCHES[2])
    coord.complete(0)
    assert stored_counts(dst, coord.completed(0), tmp_path, "c0") == expected_counts(BATCHES[:3])

    out = remove_state(store_url, "c")   # c's own files go; what it claimed lies in a's root and stays
    assert out.removed and out.claimed > 0 and _gone(dst)
    assert src.stored_files() <= claimed


def test_an_unreadable_record_of_another_state_stops_the_removal(store_url, source):
    src, _ = source
    other = CheckpointStorage.open(store_url, "b", "other-cluster")
    other.location.write_atomic(other.metadata_path(3), b'{"version": 99}')
    data, ids = src.stored_files(), src.checkpoint_ids()
    with pytest.raises(CheckpointError, match=r"other-cluster/b/chk-3.*Fix or move them first"):
        remove_state(store_url, "a")
    assert src.stored_files() == data and src.checkpoint_ids() == ids and read_lease(src.location).released


def test_dry_run_deletes_nothing_and_other_entries_stay(store_url, source):
    src, _ = source
    before = _objects(src)
    out = remove_state(store_url, "a", dry_run=True)
    assert _objects(src) == before and out.files == sorted(src.stored_files()) and out.deleted == 0
    src.location.fs.pipe_file(src.location.path("notes.txt"), b"mine")
    out = remove_state(store_url, "a")
    assert out.left == ["notes.txt"] and not out.removed
    assert _objects(src) == sorted([LEASE_FILE, "notes.txt"] + (["_lease.lock"] if src.location.is_local else []))


def test_progress_is_reported_per_data_file(store_url, source):
    src, _ = source
    n = len(src.stored_files())
    calls: list[tuple[int, int]] = []
    remove_state(store_url, "a", progress=lambda done, total: calls.append((done, total)))
    assert calls == [(i, n) for i in range(1, n + 1)]


def test_names_that_could_escape_the_root_are_refused(tmp_path, store_url):
    for bad in ("..", "../a", "a/b", ".hidden", ""):
        with pytest.raises(InvalidIdError, match="state name"):
            remove_state(store_url, bad)
    with pytest.raises(InvalidIdError, match="cluster id"):
        remove_state(store_url, "a", cluster_id="..")


def test_a_symlinked_state_root_is_refused(tmp_path):
    outside = tmp_path / "outside"
    (outside / "shared").mkdir(parents=True)
    (outside / "shared" / ("e" * 32)).write_bytes(b"not a state's")
    (tmp_path / "chk" / "default").mkdir(parents=True)
    os.symlink(outside, tmp_path / "chk" / "default" / "a")
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        remove_state(str(tmp_path / "chk"), "a")
    assert (outside / "shared" / ("e" * 32)).exists()
    os.unlink(tmp_path / "chk" / "default" / "a")
    (tmp_path / "chk" / "default" / "a").mkdir()
    os.symlink(outside / "shared", tmp_path / "chk" / "default" / "a" / "shared")
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        remove_state(str(tmp_path / "chk"), "a")
    assert (outside / "shared" / ("e" * 32)).exists()


def test_the_lease_is_held_while_the_files_go(store_url, source, monkeypatch):
    """A writer starting during the removal is refused: the state's lease is held by the removal."""
    src, _ = source
    seen: list[str] = []
    real = CheckpointStorage.delete_files

    def delete(self, paths):
        if not seen:
            with pytest.raises(StateLeaseError) as exc:
                StateLease(open_location(store_url).child("default", "a"), "a", application="late", ttl=60).acquire()
            seen.append(str(exc.value))
        return real(self, paths)

    monkeypatch.setattr(CheckpointStorage, "delete_files", delete)
    assert remove_state(store_url, "a").removed
    assert "steward checkpoints rm" in seen[0]


def test_gc_stops_deleting_when_its_lease_is_taken_over(store_url, source, monkeypatch):
    """gc renews and checks its lease before every delete: once its renewals fail for a ttl and another
    application takes the state over, it deletes nothing more and says so."""
    src, meta = source
    loc = src.location
    orphans = [f"shared/{i:032x}" for i in range(10)]
    for p in orphans:
        loc.write_atomic(loc.path(*p.split("/")), b"orphan")
    ttl, clock = 30.0, FakeClock()
    deletes: list[list[str]] = []
    real = CheckpointStorage.delete_files

    def delete(self, paths):
        deletes.append(paths)
        if len(deletes) == 3:   # no renewal of gc's got through for a ttl: another application takes over
            clock.advance(ttl)
            other = FakeClock()
            StateLease(loc, "a", application="app-new", ttl=ttl, owner=ELSEWHERE, wall=lambda: time.time() + 2 * ttl,
                       monotonic=other.now, sleep=other.sleep).acquire()
        return real(self, paths)

    monkeypatch.setattr(CheckpointStorage, "delete_files", delete)
    with pytest.raises(StateLeaseError, match=r"stopped collecting garbage in state 'a' after 3 of 10 orphaned "
                                              r"files: .*application app-new"):
        collect_garbage(store_url, "a", min_age=0, lease_ttl=ttl, monotonic=clock.now)
    assert len(deletes) == 3 and set(orphans[3:]) <= src.stored_files()
    assert read_lease(loc).application == "app-new"
    assert {f.path for f in meta.files()} <= src.stored_files()
