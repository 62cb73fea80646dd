"""A subtask's local snapshot (the output of a checkpoint's sync phase) and what the async phase
does to it before the upload: :func:`fold_wal` folds a WAL past ``wal-flush-size`` or
``wal-flush-files`` into an SST, then :func:`compact_snapshot` writes a fully compacted copy of a
snapshot whose files carry too much garbage or are too many, or of a small one just folded
(:class:`CompactionPolicy`, decisions 0019 and 0021). :func:`snapshot_files` names the files of a closed
DB that a copy needs.

Together they bound a subtask's files however long its stream runs: at most ``wal-flush-files`` WAL
files, and at most ``compaction.max-files`` SSTs above its last sorted run (one SST in all for a
subtask under ``compaction.min-size``), whatever the volume of each batch.

Both work on a closed DB that nothing else opens: the executor agent's upload thread owns the
snapshot dir until the upload. :func:`fold_wal` changes the snapshot in place (RocksDB's recovery is
crash-safe); :func:`compact_snapshot` never changes it: it compacts a copy next to it and the agent
uploads whichever of the two it returns.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import rocksdict

from sparksteward.errors import ConfigError, StateBackendError
from sparksteward.state.keygroups import KeyGroupRange
from sparksteward.state.rocksdb_options import db_options, open_db
from sparksteward.storage import NotRegularFileError, regular_files

__all__ = ["COMPACTION_MAX_FILES", "COMPACTION_MIN_BYTES", "COMPACTION_SPACE_AMPLIFICATION", "TASK_FLUSH_BYTES", "WAL_FLUSH_BYTES",
           "WAL_FLUSH_FILES", "CompactionPolicy", "LocalSnapshot", "SnapshotCompaction", "SortedRuns",
           "compact_snapshot", "fold_wal", "snapshot_files", "ssts_above_last_run", "wal_bytes"]

log = logging.getLogger("sparksteward.state.snapshot")

#: default of ``spark.steward.state.wal-flush-size``: a snapshot with more WAL than this is folded
WAL_FLUSH_BYTES = 256 << 10
#: default of ``spark.steward.state.wal-flush-files``: a snapshot with more WAL files than this is folded
WAL_FLUSH_FILES = 16
#: A task whose DB holds more WAL than this at its sync phase flushes the memtable itself (decision 0022)
TASK_FLUSH_BYTES = 64 << 10
#: default of ``spark.steward.state.compaction.max-files``: more SSTs above the last run are compacted
COMPACTION_MAX_FILES = 8
#: defaults of ``spark.steward.state.compaction.max-space-amplification`` and ``.min-size``
COMPACTION_SPACE_AMPLIFICATION = 1.25
COMPACTION_MIN_BYTES = 1 << 20
#: the least share of deletions among the entries above the last sorted run for them to count as garbage
COMPACTION_MIN_DELETIONS = 0.1

_DATA = (".sst", ".log", ".blob")   # the files that hold entries (the rest is metadata)


@dataclass(frozen=True, slots=True)
class LocalSnapshot:
    """A consistent copy of the DB on local disk (the output of the sync phase)."""

    path: Path
    key_groups: KeyGroupRange
    sync_ms: float
    flush_ms: float = 0.0  # the part of sync_ms that flushed the memtable (keep_open snapshots)

    def files(self) -> list[Path]:
        return sorted(p for p in self.path.iterdir() if p.is_file())


def snapshot_files(db_path: Path) -> list[str]:
    """The files of a closed DB that a copy needs: CURRENT, the MANIFEST it names, the newest OPTIONS,
    the SSTs and WALs, IDENTITY and rocksdict's config (not LOCK, LOG*, older OPTIONS or temp files)."""
    try:
        manifest = (db_path / "CURRENT").read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise StateBackendError(f"the state DB in {db_path} has no readable CURRENT file: {exc}") from exc
    names = os.listdir(db_path)
    options = [n for n in names if n.startswith("OPTIONS-") and n[8:].isdigit()]
    keep = {"CURRENT", "IDENTITY", "rocksdict-config.json", manifest}
    if options:
        keep.add(max(options, key=lambda n: int(n[8:])))
    return sorted(n for n in names if n in keep or n.endswith((".sst", ".log", ".blob")))


def wal_bytes(directory: Path) -> int:
    """The bytes of WAL in a DB directory."""
    return sum(p.lstat().st_size for p in directory.glob("*.log"))


def fold_wal(directory: str | os.PathLike[str], limit: int = WAL_FLUSH_BYTES, max_files: int | None = None) -> int:
    """Fold the WAL of a closed DB (a local snapshot) into an SST when it holds more than ``limit`` bytes
    or, with ``max_files``, spans more than ``max_files`` WAL files (decision 0021: every open adds
    one, so a low-volume stream would otherwise pile up hundreds of tiny WAL files that every open
    replays and every restore fetches).

    The executor agent runs this in the async phase, before the upload, so the task never flushes.
    An open with :func:`db_options` replays the WAL and flushes it at recovery (auto compactions off, so
    no existing SST is rewritten or deleted). The close afterwards finds an empty memtable. Then
    everything a copy does not need (LOCK, LOG, the old MANIFEST and OPTIONS) is removed. Returns the
    WAL bytes folded (0 also when the WAL files folded by count were empty), or 0 when under both
    limits. The state is the same; only its files differ.
    """
    directory = Path(directory)
    try:  # RocksDB would follow a symlinked WAL and recover (and delete) through it
        files = regular_files(directory)
    except NotRegularFileError as exc:
        raise StateBackendError(f"will not fold the WAL of snapshot {directory}: {exc}") from exc
    logs = [p for p in files if p.name.endswith(".log")]
    wal = sum(p.stat().st_size for p in logs)
    if wal <= limit and (max_files is None or len(logs) <= max_files):
        return 0
    try:
        db = open_db(directory, db_options(create=False), auto_compactions=False)
        db.close()
        del db
    except Exception as exc:  # rocksdict raises a bare Exception
        raise StateBackendError(f"cannot fold the {wal} B WAL of snapshot {directory} into an SST: {exc}") from exc
    keep = set(snapshot_files(directory))
    for p in directory.iterdir():
        if p.name not in keep and p.is_file():
            p.unlink()
    return wal


@dataclass(frozen=True, slots=True)
class CompactionPolicy:
    """When the async phase compacts a snapshot before its upload (decision 0019).

    A snapshot is compacted when its data (SST, WAL and blob bytes) is at least ``min_size``, more
    than ``max_space_amplification`` times its last sorted run (:class:`SortedRuns`), and at least
    :data:`COMPACTION_MIN_DELETIONS` of the entries above that run are deletions. The files above the
    last run then hold garbage: the TTL sweep's (or the user's) deletes, the entries they cover, and
    overwritten values. A full compaction leaves one run, so the bytes uploaded stay within that factor
    of the state as it was at the last compaction. Without deletions, what lies above the last run is
    mostly new keys (a growing state): rewriting and uploading the whole state again for it would
    drop little. Below 1 the policy is off.

    Two more triggers bound a subtask's files (decision 0021), and :func:`compact_snapshot` applies
    them: a snapshot with more than ``max_files`` SSTs above its last run is compacted whatever its
    size or garbage (:meth:`wants_by_count`), and a snapshot under ``min_size`` whose WAL was just
    folded is compacted into one SST (rewriting less than ``min_size`` costs little).
    """

    max_space_amplification: float = COMPACTION_SPACE_AMPLIFICATION
    min_size: int = COMPACTION_MIN_BYTES
    max_files: int = COMPACTION_MAX_FILES

    def __post_init__(self) -> None:
        if not self.max_space_amplification >= 0:   # NaN too
            raise ConfigError(f"spark.steward.state.compaction.max-space-amplification="
                              f"{self.max_space_amplification!r} is not allowed: expected a number >= 0 "
                              f"(below 1 turns the compaction off)")
        if self.min_size <= 0:
            raise ConfigError(f"spark.steward.state.compaction.min-size={self.min_size!r} is not allowed: expected "
                              f"a size > 0 such as 1m")
        if isinstance(self.max_files, bool) or not isinstance(self.max_files, int) or self.max_files <= 0:
            raise ConfigError(f"spark.steward.state.compaction.max-files={self.max_files!r} is not allowed: expected "
                              f"an integer > 0 such as {COMPACTION_MAX_FILES}")

    @property
    def enabled(self) -> bool:
        return self.max_space_amplification >= 1

    def wants(self, data: int, runs: SortedRuns) -> bool:
        """Whether a snapshot of ``data`` bytes whose SSTs are ``runs`` calls for a compaction."""
        return (self.enabled and data >= self.min_size and data > self.max_space_amplification * runs.last_run
                and runs.deletions_above > 0 and runs.deletions_above >= COMPACTION_MIN_DELETIONS * runs.entries_above)

    def wants_by_count(self, files_above: int) -> bool:
        """Whether ``files_above`` SSTs above the last sorted run call for a compaction (any size)."""
        return self.enabled and files_above > self.max_files


@dataclass(frozen=True, slots=True)
class SnapshotCompaction:
    """A compacted copy of a snapshot (:func:`compact_snapshot`): its dir, to upload instead."""

    path: Path
    bytes_before: int   # the snapshot's SST, WAL and blob bytes
    bytes_after: int    # the copy's
    ms: float


@dataclass(frozen=True, slots=True)
class SortedRuns:
    """The shape of a DB's live SSTs: the bytes of its last sorted run (its deepest non-empty level
    below L0, or, with every file in L0, the largest file), and the entries and deletions of the files
    above it. A full compaction leaves only the last run; what lies above it is at most the garbage a
    compaction could drop."""

    last_run: int
    entries_above: int
    deletions_above: int

    @classmethod
    def of(cls, live_files: Iterable[Mapping[str, object]]) -> SortedRuns:
        """From rocksdict's ``Rdict.live_files()``."""
        files = [(int(f["level"]), int(f["size"]), int(f["num_entries"]), int(f["num_deletions"]))  # type: ignore[call-overload]
                 for f in live_files]
        deepest = max((f[0] for f in files), default=0)
        if deepest > 0:
            in_last = [f[0] == deepest for f in files]
        else:   # all in L0: the largest file stands for the run the others stack on
            largest = max(range(len(files)), key=lambda i: files[i][1], default=-1)
            in_last = [i == largest for i in range(len(files))]
        last = [f for f, x in zip(files, in_last) if x]
        above = [f for f, x in zip(files, in_last) if not x]
        return cls(sum(f[1] for f in last), sum(f[2] for f in above), sum(f[3] for f in above))


def ssts_above_last_run(live_files: Iterable[Mapping[str, object]]) -> int:
    """How many of a DB's live SSTs (rocksdict's ``Rdict.live_files()``) lie above its last sorted run
    (as :class:`SortedRuns` draws it)."""
    levels = [int(f["level"]) for f in live_files]  # type: ignore[call-overload]
    deepest = max(levels, default=0)
    if deepest > 0:
        return sum(1 for lv in levels if lv != deepest)
    return max(len(levels) - 1, 0)


def compact_snapshot(directory: str | os.PathLike[str], policy: CompactionPolicy,
                     folded: bool = False) -> SnapshotCompaction | None:
    """A fully compacted copy of the snapshot in ``directory`` when ``policy`` calls for one, else None.

    The executor agent runs this in the async phase, before the upload; ``folded`` says that
    :func:`fold_wal` just folded its WAL. Below ``policy.min_size`` it only lists the dir, and
    compacts a snapshot of two SSTs or more that was ``folded`` (into one SST), or one with more than
    ``max_files`` SSTs above its last run. Otherwise a read-only open reads the levels of the live
    SSTs (about a millisecond), for :meth:`CompactionPolicy.wants` and
    :meth:`CompactionPolicy.wants_by_count`. When compacting, it hard-links the snapshot's SSTs
    (RocksDB never writes an SST again) and copies its other files into a sibling dir
    ``.<name>.<pid>.compacting``, opens that with auto compactions off (recovery flushes the WAL),
    compacts the whole key range with the bottommost level forced (tombstones and the entries they
    cover go), closes it and keeps only the files a copy needs. The snapshot itself is never changed: a compaction that fails is logged and its copy
    deleted, and the caller uploads the snapshot as it is. The state is the same; only its files differ.

    Raises :class:`StateBackendError` when the snapshot holds a non-regular file or cannot be opened
    (then no copy of it may be uploaded either).
    """
    directory = Path(directory)
    if not policy.enabled:
        return None
    try:  # RocksDB would follow a symlinked file
        files = regular_files(directory)
    except NotRegularFileError as exc:
        raise StateBackendError(f"will not compact snapshot {directory}: {exc}") from exc
    data = sum(p.stat().st_size for p in files if p.name.endswith(_DATA))
    ssts = sum(1 for p in files if p.name.endswith(".sst"))
    started = time.perf_counter()
    if data < policy.min_size:
        if folded and ssts >= 2:   # a small DB folds into one SST: rewriting it costs little
            return _compacted(directory, data, started, f"{ssts} SSTs after a WAL fold, under min-size",
                              quiet=True)
        if ssts <= policy.max_files + 1:
            return None
    try:
        db = open_db(directory, db_options(create=False), read_only=True)
        try:
            live = db.live_files()
        finally:
            db.close()
            del db
    except Exception as exc:  # rocksdict raises a bare Exception
        raise StateBackendError(f"cannot read the levels of snapshot {directory}: {exc}") from exc
    runs = SortedRuns.of(live)
    above = ssts_above_last_run(live)
    if policy.wants_by_count(above):
        why = f"{above} SSTs above its last run"
    elif data >= policy.min_size and policy.wants(data, runs):
        why = (f"last run {runs.last_run} B, {runs.deletions_above} of {runs.entries_above} entries above it "
               f"deletions")
    else:
        return None
    return _compacted(directory, data, started, why)


def _compacted(directory: Path, data: int, started: float, why: str, quiet: bool = False) -> SnapshotCompaction | None:
    """Compact a copy of ``directory`` (see :func:`compact_snapshot`); None when that fails. ``quiet``:
    a routine one (a small DB's fold), logged at DEBUG."""
    into = directory.with_name(f".{directory.name}.{os.getpid()}.compacting")
    try:
        _compact_copy(directory, into)
        after = sum(p.stat().st_size for p in into.iterdir() if p.name.endswith(_DATA))
    except Exception as exc:  # noqa: BLE001 - an optimization: the snapshot is whole, upload it instead
        shutil.rmtree(into, ignore_errors=True)
        log.warning("compaction of snapshot %s failed (%s); its files are uploaded as they are", directory, exc)
        return None
    ms = (time.perf_counter() - started) * 1000
    log.log(logging.DEBUG if quiet else logging.INFO, "compacted snapshot %s: %d B (%s) -> %d B in %.0f ms",
            directory, data, why, after, ms)
    return SnapshotCompaction(into, data, after, ms)


def _compact_copy(directory: Path, into: Path) -> None:
    """Copy the closed DB in ``directory`` into ``into`` (a new dir) and compact it fully there."""
    shutil.rmtree(into, ignore_errors=True)   # a leftover of an attempt that died
    into.mkdir()
    for name in snapshot_files(directory):
        if name.endswith((".sst", ".blob")):
            os.link(directory / name, into / name)
        else:  # a WAL, MANIFEST or config that the open may append to or rewrite: never a shared inode
            shutil.copyfile(directory / name, into / name)
    compact = rocksdict.CompactOptions()
    compact.set_bottommost_level_compaction(rocksdict.BottommostLevelCompaction.force())
    try:
        db = open_db(into, db_options(create=False), auto_compactions=False)
    except Exception as exc:  # rocksdict raises a bare Exception
        raise StateBackendError(f"cannot open the copy of snapshot {directory} in {into}: {exc}") from exc
    try:
        db.compact_range(None, None, compact)
        live = {str(f["name"]).lstrip("/") for f in db.live_files()}
    finally:
        db.close()
        del db
    keep = {n for n in snapshot_files(into) if not n.endswith(".sst") or n in live}
    for p in into.iterdir():
        if p.name not in keep:
            p.unlink()
