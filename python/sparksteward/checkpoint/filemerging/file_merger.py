"""FLIP-306 checkpoint file merging: many small logical files in a few physical files.

A *logical* file is a segment ``(physical file, offset, length)``: a :class:`FileHandle` whose path is
``merged/<uuid>``. A *physical* file has a fresh UUID name, is written once (never overwritten) and
is synced before any completed checkpoint refers to it.

**Executor side** (:class:`FileMerger`, hosted by the executor agent). The async phase of every
subtask that runs on this executor appends its small new files (MANIFEST, CURRENT, OPTIONS, SSTs
below ``max_file_size``) to the pool of its state and checkpoint; a physical file is rotated when the
next segment would take it past ``max_file_size``. The files are staged locally, so on an object
store each one is a single PUT. They are *sealed* (fsynced and uploaded) when the driver agent says
every subtask of the checkpoint has acked (so segments of all the subtasks that ran here share
files), then the driver completes the checkpoint. ``within`` mode keeps one pool per checkpoint;
``across`` mode (local stores only) keeps appending to the same physical file, in place, across
checkpoints, and a seal is an fsync.

**Driver side** (:mod:`sparksteward.checkpoint.filemerging.space`): the coordinator owns the reference
counts (placement changes every batch in Spark, so no executor can own a file; see
docs/decisions/0010). From the retained records it computes physical and live logical bytes, and when
physical bytes exceed live bytes times ``max_space_amplification`` it marks the most wasteful physical
files no-reuse: the next checkpoint writes their live segments again (the compaction), and the old
files go once no retained checkpoint references them.

Thread-safe: one lock per pool; the merger's own lock guards the pool table.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparksteward.checkpoint.records import FileHandle
from sparksteward.checkpoint.storage import MERGED_DIR
from sparksteward.enums import ParsedEnum
from sparksteward.errors import CheckpointError, ConfigError
from sparksteward.storage import fsync_dir, fsync_file

__all__ = ["MERGED_DIR", "FileMerger", "MergingMode", "MergingOptions", "SealedFile"]

log = logging.getLogger("sparksteward.checkpoint.filemerging.file_merger")

_MIN_FILE_SIZE = 64 << 10


class MergingMode(ParsedEnum):
    WITHIN = "within"
    ACROSS = "across"

    @classmethod
    def _refusal(cls, value: object) -> Exception:
        return ConfigError(f"file-merging mode {value!r} is not valid: use 'within' (every store) or "
                           f"'across' (local file systems only)")


@dataclass(frozen=True, slots=True)
class MergingOptions:
    """``spark.steward.checkpoint.file-merging.*`` of one state (Flink's semantics)."""

    enabled: bool = True
    max_file_size: int = 32 << 20
    mode: MergingMode = MergingMode.WITHIN
    max_space_amplification: float = 2.0   # < 1 disables space control, as in Flink

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", MergingMode.parse(self.mode))
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"file-merging enabled={self.enabled!r} must be true or false")
        if isinstance(self.max_file_size, bool) or not isinstance(self.max_file_size, int) \
                or self.max_file_size < _MIN_FILE_SIZE:
            raise ConfigError(f"file-merging max-file-size={self.max_file_size!r} must be at least "
                              f"{_MIN_FILE_SIZE} bytes (64k); the default is 32m")
        amp = self.max_space_amplification
        if isinstance(amp, bool) or not isinstance(amp, (int, float)) or amp != amp or amp < 0:
            raise ConfigError(f"file-merging max-space-amplification={amp!r} must be a number >= 0 "
                              f"(below 1 turns space control off; the default is 2.0)")

    def check_store(self, url: str, is_local: bool) -> None:
        """Refuse ``across`` on a store that cannot append (object stores)."""
        if self.enabled and self.mode is MergingMode.ACROSS and not is_local:
            raise ConfigError(
                f"file-merging mode 'across' needs a store that appends to a file in place, and {url} is an "
                f"object store (an object is written once, whole): set "
                f"spark.steward.checkpoint.file-merging.mode=within for it")

    def to_json(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "max_file_size": self.max_file_size, "mode": self.mode.value,
                "max_space_amplification": self.max_space_amplification}

    @classmethod
    def from_json(cls, d: Any) -> MergingOptions:
        if d is None:
            return cls(enabled=False)
        if not isinstance(d, dict):
            raise ConfigError(f"file-merging options {d!r} are not an object")
        return cls(enabled=d.get("enabled", True), max_file_size=d.get("max_file_size", 32 << 20),
                   mode=d.get("mode", "within"), max_space_amplification=d.get("max_space_amplification", 2.0))

    @classmethod
    def from_config(cls, cfg: Any) -> MergingOptions:
        return cls(enabled=bool(cfg.checkpoint_file_merging_enabled),
                   max_file_size=int(cfg.checkpoint_file_merging_max_file_size),
                   mode=cfg.checkpoint_file_merging_mode,
                   max_space_amplification=float(cfg.checkpoint_file_merging_max_space_amplification))


# --- executor side ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SealedFile:
    path: str    # merged/<uuid>, relative to the state's checkpoint root
    size: int    # bytes durable at the time of the seal


@dataclass
class _Physical:
    rel: str
    local: Path          # the staged file (within) or the file itself (across, local store)
    size: int = 0
    durable: int = -1    # bytes synced and visible in the store (-1: never sealed, even if empty)
    closed: bool = False


@dataclass
class _Pool:
    """The physical files one checkpoint of one state wrote on this executor (across: all checkpoints)."""

    root_url: str
    options: MergingOptions
    put: Callable[[Path, str], None]       # uploads a staged file to a relative path (within)
    target: Callable[[str], str] | None    # the local path of a relative path (across)
    lock: threading.Lock = field(default_factory=threading.Lock)
    dead: bool = False                     # sealed or discarded (within): appends take a new pool
    files: list[_Physical] = field(default_factory=list)
    touched: dict[int, set[str]] = field(default_factory=dict)   # checkpoint -> physical files it wrote to


class FileMerger:
    """The physical files this executor is writing, per state (and checkpoint in ``within`` mode).

    ``staging``: a private local directory for ``within`` mode's staged files (deleted on close).
    """

    def __init__(self, staging: str | os.PathLike[str]) -> None:
        self.staging = Path(staging)
        self.staging.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._pools: dict[tuple[str, int | None], _Pool] = {}
        self._closed = False
        self._closed_files: list[tuple[str, str]] = []   # across: (root URL, path) closed, not reported yet

    def _pool(self, root_url: str, checkpoint_id: int, options: MergingOptions, put: Callable[[Path, str], None],
              target: Callable[[str], str] | None) -> tuple[tuple[str, int | None], _Pool]:
        across = options.mode is MergingMode.ACROSS
        key = (root_url, None if across else checkpoint_id)
        with self._lock:
            if self._closed:
                raise CheckpointError("the file merger is closed (the executor agent is shutting down)")
            pool = self._pools.get(key)
            if pool is None:
                if across and target is None:
                    raise CheckpointError(f"file-merging mode 'across' needs a local store, not {root_url}")
                pool = self._pools[key] = _Pool(root_url, options, put, target if across else None)
            return key, pool

    def append(self, root_url: str, checkpoint_id: int, options: MergingOptions, name: str, local: Path,
               checksum: str, put: Callable[[Path, str], None],
               target: Callable[[str], str] | None = None) -> FileHandle:
        """Append ``local`` to the open physical file of the pool; return its segment's handle."""
        size = local.stat().st_size
        while True:
            _, pool = self._pool(root_url, checkpoint_id, options, put, target)
            with pool.lock:
                if not pool.dead:
                    return self._append(pool, checkpoint_id, options, name, local, checksum, size)

    def _append(self, pool: _Pool, checkpoint_id: int, options: MergingOptions, name: str, local: Path,
                checksum: str, size: int) -> FileHandle:
        cur = pool.files[-1] if pool.files and not pool.files[-1].closed else None
        if cur is not None and cur.size > 0 and cur.size + size > options.max_file_size:
            self._close(pool, cur)   # rotate: the file is full
            cur = None
        if cur is None:
            rel = f"{MERGED_DIR}/{uuid.uuid4().hex}"
            if pool.target is not None:   # across: append in place in the store
                path = Path(pool.target(rel))
                path.parent.mkdir(parents=True, exist_ok=True)
            else:
                path = self.staging / rel.replace("/", "-")
            cur = _Physical(rel, path)
            pool.files.append(cur)
        offset = cur.size
        with open(cur.local, "ab") as out, open(local, "rb") as src:
            if out.tell() != offset:  # a torn earlier append: never write past what we recorded
                out.truncate(offset)
            shutil.copyfileobj(src, out, 1 << 20)
        cur.size += size
        pool.touched.setdefault(checkpoint_id, set()).add(cur.rel)
        return FileHandle(name=name, path=cur.rel, length=size, checksum=checksum, offset=offset)

    def pending(self) -> list[tuple[str, int]]:
        """(root URL, checkpoint id) of every checkpoint with segments not sealed yet."""
        with self._lock:
            pools = list(self._pools.values())
        out: list[tuple[str, int]] = []
        for pool in pools:
            with pool.lock:
                out.extend((pool.root_url, cid) for cid in pool.touched)
        return sorted(set(out))

    def seal(self, root_url: str, checkpoint_id: int) -> list[SealedFile]:
        """Make checkpoint ``checkpoint_id``'s physical files durable in the store; return them.

        ``within``: each staged file is synced, uploaded (one PUT) and deleted locally. ``across``:
        the files are fsynced in place and stay open for the next checkpoints until full.
        """
        pool = self._find(root_url, checkpoint_id)
        if pool is None:
            return []
        with pool.lock:
            rels = pool.touched.get(checkpoint_id, set())
            files = [p for p in pool.files if p.rel in rels]
            for p in files:
                if p.durable == p.size:
                    continue
                fsync_file(p.local)
                if pool.target is None:
                    pool.put(p.local, p.rel)
                else:
                    fsync_dir(p.local.parent)
                p.durable = p.size
            sealed = [SealedFile(p.rel, p.durable) for p in files]
            pool.touched.pop(checkpoint_id, None)
            if pool.target is None:   # within: the pool of this checkpoint is done
                for p in files:
                    with contextlib.suppress(FileNotFoundError):
                        p.local.unlink()
                self._drop(pool, root_url, checkpoint_id)
            else:
                _keep_open(pool)
        log.debug("sealed %d physical files of checkpoint %d in %s", len(sealed), checkpoint_id, root_url)
        return sealed

    def discard(self, root_url: str, checkpoint_id: int) -> list[str]:
        """Forget checkpoint ``checkpoint_id`` (aborted, or not needed): drop its staged files.

        In ``across`` mode a file it wrote to is closed (no more appends) and left to the driver
        agent's reference counts. Returns the relative paths the checkpoint wrote.
        """
        pool = self._find(root_url, checkpoint_id)
        if pool is None:
            return []
        with pool.lock:
            rels = pool.touched.pop(checkpoint_id, set())
            for p in pool.files:
                if p.rel in rels:
                    self._close(pool, p)
                    if pool.target is None:
                        with contextlib.suppress(FileNotFoundError):
                            p.local.unlink()
            if pool.target is None:
                self._drop(pool, root_url, checkpoint_id)
            else:
                _keep_open(pool)
        return sorted(rels)

    def _close(self, pool: _Pool, p: _Physical) -> None:
        if not p.closed:
            p.closed = True
            if pool.target is not None:
                with self._lock:
                    self._closed_files.append((pool.root_url, p.rel))

    def drain_closed(self) -> list[tuple[str, str]]:
        """``across``: (root URL, path) of the files closed since the last call (no more appends)."""
        with self._lock:
            out, self._closed_files = self._closed_files, []
            return out

    def open_files(self) -> list[tuple[str, str]]:
        """(root URL, relative path) of the ``across`` files still open for appends."""
        with self._lock:
            pools = [p for p in self._pools.values() if p.target is not None]
        out: list[tuple[str, str]] = []
        for pool in pools:
            with pool.lock:
                out.extend((pool.root_url, p.rel) for p in pool.files if not p.closed)
        return out

    def _find(self, root_url: str, checkpoint_id: int) -> _Pool | None:
        with self._lock:
            return self._pools.get((root_url, checkpoint_id)) or self._pools.get((root_url, None))

    def _drop(self, pool: _Pool, root_url: str, checkpoint_id: int) -> None:
        pool.dead = True   # the caller holds pool.lock
        with self._lock:
            if self._pools.get((root_url, checkpoint_id)) is pool:
                del self._pools[(root_url, checkpoint_id)]

    def close(self) -> None:
        """Drop every staged file. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._pools.clear()
        shutil.rmtree(self.staging, ignore_errors=True)

    def __enter__(self) -> FileMerger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _keep_open(pool: _Pool) -> None:
    """Forget the closed files no pending checkpoint of ``pool`` still has to seal."""
    pending = set().union(*pool.touched.values()) if pool.touched else set()
    pool.files = [p for p in pool.files if not p.closed or p.rel in pending]
