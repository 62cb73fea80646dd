"""The async phase's compaction policy: a snapshot whose files carry much garbage is uploaded as a fully
compacted copy with the same entries; a small or already compact one is left alone; a compaction that
fails leaves the snapshot whole and uploadable, and a snapshot that cannot be read fails its upload."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import rocksdict
from sparksteward.checkpoint.coordination.coordinator import CheckpointCoordinator
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.checkpoint.task.cache import LocalFileCache
from sparksteward.checkpoint.task.subtask_restore import restore_subtask_backend
from sparksteward.checkpoint.task.uploader import SnapshotUploader
from sparksteward.errors import ConfigError, StateBackendError
from sparksteward.state import snapshot as snapshot_mod
from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.keygroups import KeyGroupRange
from sparksteward.state.snapshot import CompactionPolicy, SortedRuns, compact_snapshot

M = 128
ALL = KeyGroupRange(0, M)
SMALL = CompactionPolicy(1.25, 64 << 10)   # the default factor; a floor these small DBs pass


def garbage_snapshot(tmp_path, name="snap", n=20_000):
    """A closed snapshot as a task leaves it after a few batches over a churning key space: one fully
    compacted run, then an L0 SST of overwrites and deletes (the TTL sweep's), then more of both in
    the WAL."""
    b = RocksDBStateBackend(tmp_path / f"w-{name}", ALL, M)
    s = b.value("s")
    keys = [f"k{i}" for i in range(n)]
    s.put_many(keys, [os.urandom(16).hex() for _ in keys])
    compact = rocksdict.CompactOptions()
    compact.set_bottommost_level_compaction(rocksdict.BottommostLevelCompaction.force())
    b.db.compact_range(None, None, compact)   # flushes, then one run at the bottom
    s.put_many(keys[: n // 2], [os.urandom(16).hex() for _ in range(n // 2)])
    s.put_many(keys[n // 2: 3 * n // 4], [None] * (n // 4))
    b.db.flush(True)
    s.put_many(keys[:2000], [os.urandom(16).hex() for _ in range(2000)])
    s.put_many(keys[3 * n // 4: 3 * n // 4 + 2000], [None] * 2000)
    return b.snapshot(tmp_path / name)


def entries(db_dir):
    """Every raw (key, value) of a closed DB, read through a read-only open."""
    db = rocksdict.Rdict(str(db_dir), rocksdict.Options(raw_mode=True), access_type=rocksdict.AccessType.read_only())
    try:
        return list(db.items())
    finally:
        db.close()
        del db


def fingerprint(directory):
    """The names and contents of a dir's files."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def data_bytes(directory):
    return sum(p.stat().st_size for p in directory.iterdir() if p.name.endswith((".sst", ".log")))


def sorted_runs(db_dir):
    db = rocksdict.Rdict(str(db_dir), rocksdict.Options(raw_mode=True), access_type=rocksdict.AccessType.read_only())
    try:
        return SortedRuns.of(db.live_files())
    finally:
        db.close()
        del db


def levels(db_dir):
    db = rocksdict.Rdict(str(db_dir), rocksdict.Options(raw_mode=True), access_type=rocksdict.AccessType.read_only())
    try:
        return [(f["level"], f["num_deletions"]) for f in db.live_files()]
    finally:
        db.close()
        del db


def test_the_policy_is_validated_and_reads_the_last_run():
    with pytest.raises(ConfigError, match=r"compaction.max-space-amplification=-1 .* >= 0"):
        CompactionPolicy(-1)
    with pytest.raises(ConfigError, match=r"compaction.min-size=0 .* size > 0"):
        CompactionPolicy(1.25, 0)

    def f(level, size, entries=10, deletions=0):
        return {"level": level, "size": size, "num_entries": entries, "num_deletions": deletions}

    files = [f(0, 300, 10, 5), f(0, 500, 10, 0), f(2, 50, 20, 1), f(6, 700), f(6, 400)]
    assert SortedRuns.of(files) == SortedRuns(1100, 40, 6)    # the deepest level below L0; the rest above
    assert SortedRuns.of(files[:2]) == SortedRuns(500, 10, 5)   # all in L0: the largest file
    assert SortedRuns.of([f(0, 500), f(0, 500, 10, 3)]) == SortedRuns(500, 10, 3)   # one of two equal files
    assert SortedRuns.of([]) == SortedRuns(0, 0, 0)
    assert not CompactionPolicy(0.5).enabled and not CompactionPolicy(0.5).wants(10 << 20, SortedRuns(1, 10, 10))
    p = CompactionPolicy(1.25, 1000)
    assert p.wants(1300, SortedRuns(1000, 100, 10)) and not p.wants(1250, SortedRuns(1000, 100, 10))
    assert not p.wants(999, SortedRuns(1, 100, 10))              # under min-size
    assert not p.wants(5000, SortedRuns(1000, 100, 9))           # new entries, few deletions: growth
    assert not p.wants(5000, SortedRuns(1000, 0, 0))


def test_a_snapshot_with_much_garbage_is_compacted_into_a_copy_with_the_same_entries(tmp_path):
    snap = garbage_snapshot(tmp_path)
    before = entries(snap.path)
    original = fingerprint(snap.path)
    assert any(lvl == 0 and dels for lvl, dels in levels(snap.path))   # the tombstones sit in L0
    done = compact_snapshot(snap.path, SMALL)
    assert done is not None and done.path.parent == snap.path.parent and done.path != snap.path
    assert fingerprint(snap.path) == original      # the snapshot itself is never changed
    assert done.bytes_before == data_bytes(snap.path) and done.bytes_after == data_bytes(done.path)
    assert done.bytes_after < done.bytes_before / 1.25
    assert entries(done.path) == before            # every key and value, in order
    assert {lvl for lvl, _ in levels(done.path)} == {6} and all(d == 0 for _, d in levels(done.path))
    names = {p.name for p in done.path.iterdir()}
    assert not names & {"LOCK", "LOG"} and sum(n.startswith("MANIFEST-") for n in names) == 1
    assert sum(n.startswith("OPTIONS-") for n in names) == 1
    assert sum(p.stat().st_size for p in done.path.glob("*.log")) < 64   # the WAL went into the SST
    # a task opens it as it opens any restored snapshot
    (tmp_path / "r").mkdir()
    os.rename(done.path, tmp_path / "r" / "db")
    with RocksDBStateBackend(tmp_path / "r", ALL, M, create=False) as b:
        assert list(b.iter_raw()) == before
    # compacted already: the next policy check leaves it alone
    assert compact_snapshot(tmp_path / "r" / "db", SMALL) is None


def test_small_or_compact_snapshots_are_left_alone(tmp_path, monkeypatch):
    snap = garbage_snapshot(tmp_path)
    original = fingerprint(snap.path)
    opened = []
    real = rocksdict.Rdict
    monkeypatch.setattr(snapshot_mod.rocksdict, "Rdict", lambda *a, **kw: opened.append(a) or real(*a, **kw))
    assert compact_snapshot(snap.path, CompactionPolicy(1.25, 64 << 20)) is None   # under min-size
    assert compact_snapshot(snap.path, CompactionPolicy(0)) is None                # off
    assert opened == []                            # neither opened the DB
    assert compact_snapshot(snap.path, CompactionPolicy(10.0, 64 << 10)) is None   # under the factor
    assert len(opened) == 1                        # one read-only open, to read the levels
    assert fingerprint(snap.path) == original
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".compacting")]


def test_a_growing_state_without_deletions_is_left_alone(tmp_path):
    """New keys above the last run are growth, not garbage: no rewrite of the whole state for them."""
    b = RocksDBStateBackend(tmp_path / "w", ALL, M)
    s = b.value("s")
    s.put_many([f"k{i}" for i in range(10_000)], [os.urandom(16).hex() for _ in range(10_000)])
    compact = rocksdict.CompactOptions()
    compact.set_bottommost_level_compaction(rocksdict.BottommostLevelCompaction.force())
    b.db.compact_range(None, None, compact)
    s.put_many([f"n{i}" for i in range(10_000)], [os.urandom(16).hex() for _ in range(10_000)])
    b.db.flush(True)
    snap = b.snapshot(tmp_path / "snap")
    runs = sorted_runs(snap.path)
    assert data_bytes(snap.path) > 1.8 * runs.last_run and runs.deletions_above == 0   # twice the last run
    assert compact_snapshot(snap.path, SMALL) is None


def test_a_snapshot_with_more_than_max_files_ssts_above_its_last_run_is_compacted_whatever_its_size(tmp_path):
    """Decision 0021: files per subtask stay bounded. A small growing state (no garbage, under min-size)
    whose folds piled up L0 SSTs is compacted into one run once more than max-files lie above it, and
    left alone at max-files."""
    def l0_snapshot(name, ssts):
        b = RocksDBStateBackend(tmp_path / f"w-{name}", ALL, M)
        b.db.set_options({"disable_auto_compactions": "true"})
        s = b.value("s")
        for f in range(ssts):   # one L0 SST per flush, as each WAL fold adds one
            s.put_many([f"k{f}-{i}" for i in range(200)], [os.urandom(8).hex() for _ in range(200)])
            b.db.flush(True)
        return b.snapshot(tmp_path / name)

    policy = CompactionPolicy(1.25, 64 << 20, max_files=3)   # min-size far above these DBs
    at_max = l0_snapshot("at-max", 4)                         # 3 above the largest
    assert len([f for f in os.listdir(at_max.path) if f.endswith(".sst")]) == 4
    assert compact_snapshot(at_max.path, policy) is None
    over = l0_snapshot("over", 5)                             # 4 above the largest
    before = entries(over.path)
    done = compact_snapshot(over.path, policy)
    assert done is not None
    assert len([f for f in os.listdir(done.path) if f.endswith(".sst")]) == 1
    assert entries(done.path) == before


def _upload(tmp_path, snap, policy, fold_wal_above=256 << 10, **submit):
    """Upload ``snap`` as the executor agent does; return the storage, the checkpoint (None if the
    upload failed) and the upload's results."""
    storage = CheckpointStorage.open(str(tmp_path / "chk"), "s")
    coord = CheckpointCoordinator(storage, 1, M)
    begun = coord.begin(0)
    results = []
    with SnapshotUploader(threads=1) as up:
        fut = up.submit(storage, 0, 0, snap, begun.known, on_done=lambda cid, r: (coord.ack(cid, r), results.append(r)),
                        fold_wal_above=fold_wal_above, compaction=policy, **submit)
        fut.exception(60)
    return storage, (coord.complete(0) if results else None), results


def _restored(tmp_path, storage, meta):
    backend, _ = restore_subtask_backend(storage, meta, 0, tmp_path / "restored", LocalFileCache(tmp_path / "cache"))
    with backend:
        return list(backend.iter_raw())


def test_the_uploader_uploads_the_compacted_copy_and_removes_both(tmp_path):
    snap = garbage_snapshot(tmp_path)
    before, size = entries(snap.path), data_bytes(snap.path)
    storage, meta, results = _upload(tmp_path, snap, SMALL)
    assert results[0].bytes_uploaded < size / 1.25   # only the compacted run (and metadata) went up
    assert _restored(tmp_path, storage, meta) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith((".snap", "snap"))] == []


def test_the_policy_looks_at_the_snapshot_after_its_wal_is_folded(tmp_path):
    """A ZSTD-compressed WAL folds into an SST several times its size: the uploader folds first, so the
    bound holds for what is uploaded."""
    import pyarrow as pa

    b = RocksDBStateBackend(tmp_path / "w", ALL, M, "long")
    s = b.value("s")
    s.put_many(pa.array(range(40_000)), list(range(40_000)))
    compact = rocksdict.CompactOptions()
    compact.set_bottommost_level_compaction(rocksdict.BottommostLevelCompaction.force())
    b.db.compact_range(None, None, compact)
    s.put_many(pa.array(range(6_000)), [7] * 6_000)
    s.put_many(pa.array(range(6_000, 12_000)), [None] * 6_000)
    snap = b.snapshot(tmp_path / "snap")
    before = entries(snap.path)
    assert compact_snapshot(snap.path, SMALL) is None   # the WAL, as compressed, stays under the factor
    storage, meta, results = _upload(tmp_path, snap, SMALL, fold_wal_above=0)
    names = [f.name for f in results[0].handle.files]
    assert sum(n.endswith(".sst") for n in names) == 1   # folded, then compacted into one run
    assert _restored(tmp_path, storage, meta) == before


@pytest.mark.parametrize("where", ["link", "compact", "cleanup"])
def test_a_compaction_that_fails_uploads_the_snapshot_as_it_is(tmp_path, monkeypatch, caplog, where):
    snap = garbage_snapshot(tmp_path)
    before, original = entries(snap.path), fingerprint(snap.path)
    if where == "link":   # the copy is half linked
        real_link, calls = os.link, []

        def link(src, dst, *a, **kw):
            if ".compacting" in str(dst):
                calls.append(dst)
                if len(calls) % 2 == 0:   # the second link of every attempt
                    raise OSError(28, "No space left on device")
            return real_link(src, dst, *a, **kw)

        monkeypatch.setattr(snapshot_mod.os, "link", link)
        assert len(list(snap.path.glob("*.sst"))) >= 2
    elif where == "compact":   # RocksDB fails mid-way
        real_rdict = rocksdict.Rdict

        class Failing:
            def __init__(self, *a, **kw):
                self._db = real_rdict(*a, **kw)

            def compact_range(self, *a):
                raise Exception("IO error: No space left on device")  # what rocksdict raises

            def __getattr__(self, name):
                return getattr(self._db, name)

        monkeypatch.setattr(snapshot_mod.rocksdict, "Rdict", Failing)
    else:   # compacted, then the clean-up of the copy fails: it must not be uploaded half cleaned
        real_files = snapshot_mod.snapshot_files

        def files(d):
            if ".compacting" in str(d) and (d / "LOCK").exists():
                raise OSError(5, "Input/output error")
            return real_files(d)

        monkeypatch.setattr(snapshot_mod, "snapshot_files", files)
    with caplog.at_level(logging.WARNING, "sparksteward.state.snapshot"):
        assert compact_snapshot(snap.path, SMALL) is None
    assert "failed" in caplog.text and "uploaded as they are" in caplog.text
    assert fingerprint(snap.path) == original
    assert not [p for p in tmp_path.iterdir() if ".compacting" in p.name]
    storage, meta, results = _upload(tmp_path, snap, SMALL)   # the same failure inside the uploader
    assert meta is not None and _restored(tmp_path, storage, meta) == before
    assert {f.name for f in results[0].handle.files} == set(original)   # the snapshot's own files
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".snap", "snap"))]


def test_a_snapshot_that_cannot_be_read_fails_its_upload_cleanly(tmp_path):
    snap = garbage_snapshot(tmp_path)
    manifest = (snap.path / "CURRENT").read_text().strip()
    (snap.path / manifest).write_bytes(b"\0" * 100)   # a torn MANIFEST
    with pytest.raises(StateBackendError, match="cannot read the levels of snapshot"):
        compact_snapshot(snap.path, SMALL)
    errors = []
    storage, meta, results = _upload(tmp_path, snap, SMALL,
                                     on_error=lambda cid, i, exc: errors.append(str(exc)))
    assert meta is None and results == [] and "cannot read the levels" in errors[0]
    assert not [p for p in (tmp_path / "chk").rglob("*") if p.is_file() and "shared" in p.parts]  # nothing uploaded
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".snap", "snap"))]


def test_a_process_killed_mid_compaction_leaves_the_snapshot_whole(tmp_path):
    """SIGKILL after RocksDB compacted the copy, before its clean-up: the snapshot is untouched, and
    the next compaction next to the leftover copy works."""
    snap = garbage_snapshot(tmp_path)
    before, original = entries(snap.path), fingerprint(snap.path)
    code = textwrap.dedent(f"""
        import os, signal
        from sparksteward.state import snapshot
        from sparksteward.state.snapshot import CompactionPolicy, compact_snapshot

        real = snapshot.snapshot_files
        def files(d):
            if ".compacting" in str(d) and (d / "LOCK").exists():
                os.kill(os.getpid(), signal.SIGKILL)
            return real(d)
        snapshot.snapshot_files = files
        compact_snapshot({str(snap.path)!r}, CompactionPolicy(1.25, 64 << 10))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert [p for p in tmp_path.iterdir() if ".compacting" in p.name]   # the dead process's copy
    assert fingerprint(snap.path) == original and entries(snap.path) == before
    done = compact_snapshot(snap.path, SMALL)
    assert done is not None and entries(done.path) == before
