"""A subtask's local snapshot (the output of a checkpoint's sync phase) and what the async phase
does to it before the upload: :func:`fold_wal` folds a WAL past ``wal-flush-size`` into an SST.
:func:`snapshot_files` names the files of a closed DB that a copy needs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import rocksdict

from sparksteward.errors import StateBackendError
from sparksteward.state.keygroups import KeyGroupRange
from sparksteward.state.rocksdb_options import db_options
from sparksteward.storage import NotRegularFileError, regular_files

__all__ = ["WAL_FLUSH_BYTES", "LocalSnapshot", "fold_wal", "snapshot_files", "wal_bytes"]

#: default of ``spark.steward.state.wal-flush-size``: a snapshot with more WAL than this is folded
WAL_FLUSH_BYTES = 256 << 10


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
