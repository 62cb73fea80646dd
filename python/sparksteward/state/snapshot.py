"""A subtask's local snapshot (the output of a checkpoint's sync phase) and what the async phase
does to it before the upload: :func:`compact_snapshot` writes a fully compacted copy of a snapshot
whose files carry too much garbage (:class:`CompactionPolicy`, decision 0019), and :func:`fold_wal`
folds a WAL past ``wal-flush-size`` into an SST. :func:`snapshot_files` names the files of a closed DB
that a copy needs.

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
from sparksteward.state.rocksdb_options import db_options
from sparksteward.storage import NotRegularFileError, regular_files

__all__ = ["COMPACTION_MIN_BYTES", "COMPACTION_SPACE_AMPLIFICATION", "WAL_FLUSH_BYTES", "CompactionPolicy",
           "LocalSnapshot", "SnapshotCompaction", "compact_snapshot", "fold_wal", "last_run_bytes",
           "snapshot_files", "wal_bytes"]

log = logging.getLogger("sparksteward.state.snapshot")

#: default of ``spark.steward.state.wal-flush-size``: a snapshot with more WAL than this is folded
WAL_FLUSH_BYTES = 256 << 10
#: defaults of ``spark.steward.state.compaction.max-space-amplification`` and ``.min-size``
COMPACTION_SPACE_AMPLIFICATION = 1.25
COMPACTION_MIN_BYTES = 1 << 20

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


def fold_wal(directory: str | os.PathLike[str], limit: int = WAL_FLUSH_BYTES) -> int:
    """Fold the WAL of a closed DB (a local snapshot) into an SST when it holds more than ``limit`` bytes.

    The executor agent runs this in the async phase, before the upload, so the task never flushes.
    An open with :func:`db_options` replays the WAL and flushes it at recovery (auto compactions off, so
    no existing SST is rewritten or deleted). The close afterwards finds an empty memtable. Then
    everything a copy does not need (LOCK, LOG, the old MANIFEST and OPTIONS) is removed. Returns the
    WAL bytes folded, or 0 when under the limit. The state is the same; only its files differ.
    """
    directory = Path(directory)
    try:  # RocksDB would follow a symlinked WAL and recover (and delete) through it
        files = regular_files(directory)
    except NotRegularFileError as exc:
        raise StateBackendError(f"will not fold the WAL of snapshot {directory}: {exc}") from exc
    wal = sum(p.stat().st_size for p in files if p.name.endswith(".log"))
    if wal <= limit:
        return 0
    opts = db_options(create=False)
    opts.set_disable_auto_compactions(True)
    try:
        db = rocksdict.Rdict(str(directory), opts)
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

    A snapshot is compacted when its data (SST, WAL and blob bytes) is at least ``min_size`` and more
    than ``max_space_amplification`` times its last sorted run (:func:`last_run_bytes`). Everything
    above the last run may be garbage: overwritten values, entries the TTL sweep deleted and their
    tombstones. A full compaction leaves one run, so the bytes uploaded stay within that factor of the
    live state. Below 1 the policy is off.
    """

    max_space_amplification: float = COMPACTION_SPACE_AMPLIFICATION
    min_size: int = COMPACTION_MIN_BYTES

    def __post_init__(self) -> None:
        if not self.max_space_amplification >= 0:   # NaN too
            raise ConfigError(f"spark.steward.state.compaction.max-space-amplification="
                              f"{self.max_space_amplification!r} is not allowed: expected a number >= 0 "
                              f"(below 1 turns the compaction off)")
        if self.min_size <= 0:
            raise ConfigError(f"spark.steward.state.compaction.min-size={self.min_size!r} is not allowed: expected "
                              f"a size > 0 such as 1m")

    @property
    def enabled(self) -> bool:
        return self.max_space_amplification >= 1

    def wants(self, data: int, last_run: int) -> bool:
        """Whether ``data`` bytes over a last sorted run of ``last_run`` bytes call for a compaction."""
        return self.enabled and data >= self.min_size and data > self.max_space_amplification * last_run


@dataclass(frozen=True, slots=True)
class SnapshotCompaction:
    """A compacted copy of a snapshot (:func:`compact_snapshot`): its dir, to upload instead."""

    path: Path
    bytes_before: int   # the snapshot's SST, WAL and blob bytes
    bytes_after: int    # the copy's
    ms: float


def last_run_bytes(live_files: Iterable[Mapping[str, object]]) -> int:
    """The bytes of the last sorted run among ``live_files`` (rocksdict's ``Rdict.live_files()``): its
    deepest non-empty level below L0, or, with every file in L0, the largest file. A full compaction
    leaves only that run; what lies above it is at most the garbage a compaction could drop."""
    levels: dict[int, int] = {}
    largest_l0 = 0
    for f in live_files:
        level, size = int(f["level"]), int(f["size"])  # type: ignore[call-overload]
        levels[level] = levels.get(level, 0) + size
        if level == 0:
            largest_l0 = max(largest_l0, size)
    deeper = [lvl for lvl in levels if lvl > 0]
    return levels[max(deeper)] if deeper else largest_l0


def compact_snapshot(directory: str | os.PathLike[str], policy: CompactionPolicy) -> SnapshotCompaction | None:
    """A fully compacted copy of the snapshot in ``directory`` when ``policy`` calls for one, else None.

    The executor agent runs this in the async phase, before the upload. Below ``policy.min_size`` it
    only lists the dir. Otherwise a read-only open reads the levels of the live SSTs (about a
    millisecond). When compacting, it hard-links the snapshot's SSTs (RocksDB never writes an SST
    again) and copies its other files into a sibling dir ``.<name>.<pid>.compacting``, opens that with
    auto compactions off (recovery flushes the WAL), compacts the whole key range with the bottommost
    level forced (tombstones and the entries they cover go), closes it and keeps only the files a copy
    needs. The snapshot itself is never changed: a compaction that fails is logged and its copy
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
    if data < policy.min_size:
        return None
    started = time.perf_counter()
    try:
        db = rocksdict.Rdict(str(directory), db_options(create=False), access_type=rocksdict.AccessType.read_only())
        try:
            live = db.live_files()
        finally:
            db.close()
            del db
    except Exception as exc:  # rocksdict raises a bare Exception
        raise StateBackendError(f"cannot read the levels of snapshot {directory}: {exc}") from exc
    last_run = last_run_bytes(live)
    if not policy.wants(data, last_run):
        return None
    into = directory.with_name(f".{directory.name}.{os.getpid()}.compacting")
    try:
        _compact_copy(directory, into)
        after = sum(p.stat().st_size for p in into.iterdir() if p.name.endswith(_DATA))
    except Exception as exc:  # noqa: BLE001 - an optimization: the snapshot is whole, upload it instead
        shutil.rmtree(into, ignore_errors=True)
        log.warning("compaction of snapshot %s failed (%s); its files are uploaded as they are", directory, exc)
        return None
    ms = (time.perf_counter() - started) * 1000
    log.info("compacted snapshot %s: %d B (last run %d B) -> %d B in %.0f ms", directory, data, last_run, after, ms)
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
    opts = db_options(create=False)
    opts.set_disable_auto_compactions(True)
    compact = rocksdict.CompactOptions()
    compact.set_bottommost_level_compaction(rocksdict.BottommostLevelCompaction.force())
    try:
        db = rocksdict.Rdict(str(into), opts)
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
