"""The task-side keyed state backend of one subtask: a local RocksDB (through rocksdict).

A :class:`RocksDBStateBackend` owns one working directory ``<dir>/db`` for the key groups of one
subtask. State is reached through typed views:

- :class:`ValueState` (``get``/``update``/``clear``, plus vectorized ``get_many``/``put_many``),
- :class:`MapState` (``get``/``put``/``remove``/``items``/``clear`` for one key),
- :class:`ListState` (``get``/``add``/``add_all``/``update``/``clear``; the list is one value),

each also bindable to a current key (:meth:`ValueState.bind`) for the per-key user API. Keys and values
are encoded by :mod:`sparksteward.state.encoding`. ``put_many`` uses one ``WriteBatch``.

Writes go to the memtable and to RocksDB's WAL, never synced (a checkpoint, not the WAL, is what makes
state durable; the working dir is scratch). :meth:`RocksDBStateBackend.snapshot` is the sync phase of a
checkpoint (decision 0012): it closes the DB *without* flushing the memtable, so the batch's writes stay
in the WAL file, and hard-links the closed DB's live files into a new local directory. A closed DB
directory cannot be torn by a compaction, and no file is written or fsynced, so it takes about a
millisecond. The next open replays the WAL without flushing it (``avoid_flush_during_recovery``).
In the async phase the executor agent folds a snapshot with more than ``wal-flush-size`` of WAL into
an SST (:func:`fold_wal`), so WAL files stay a short changelog on top of the SSTs. ``snapshot(keep_open=True)``
is ``Checkpoint.create_checkpoint`` (a memtable flush plus about six fsyncs) for a DB that stays open.
The async phase (upload) runs elsewhere, on the returned :class:`LocalSnapshot`.

Not thread-safe: one task thread uses one backend. ``close()`` releases RocksDB's LOCK without a flush;
it first drops every iterator and Checkpoint object the backend made, because rocksdict keeps the LOCK
while any of them is alive.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import rocksdict
import xxhash

from sparksteward.errors import StateBackendError, StateEncodingError
from sparksteward.storage import NotRegularFileError, regular_files
from sparksteward.state.encoding import (
    KIND_LIST,
    KIND_MAP,
    KIND_VALUE,
    decode_value,
    encode_value,
    group_bounds,
    key_prefix,
    state_key,
)
from sparksteward.state.keygroups import (
    SPARK_HASH_SEED,
    KeyGroupRange,
    KeyType,
    key_bytes,
    key_group_of_bytes,
)

__all__ = ["BoundListState", "BoundMapState", "BoundValueState", "ListState", "LocalSnapshot", "MapState",
           "RocksDBStateBackend", "ValueState", "db_options", "fold_wal"]

log = logging.getLogger("sparksteward.state.backend")

DB_DIR = "db"
#: default of ``spark.steward.state.wal-flush-size``: a snapshot with more WAL than this is folded
WAL_FLUSH_BYTES = 256 << 10


def db_options(*, create: bool) -> rocksdict.Options:
    """The options a keyed-state DB is created with (raw byte keys; create only when new)."""
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(create)
    return opts


def reopen_options() -> rocksdict.Options:
    """The options a DB is written with after its creation: :func:`db_options` plus
    ``avoid_flush_during_recovery``, so the WAL a snapshot kept is replayed, not flushed into a new
    SST (with fsyncs) at every open, and ``wal_compression=kZSTD``, so the WAL a checkpoint uploads is
    compressed (any open reads it back; the compression is recorded in the WAL itself).

    rocksdict has no setter for either, so they are read through ``Options.load_latest`` from an
    OPTIONS file RocksDB wrote for :func:`db_options`, with those lines changed, and tried on a scratch
    DB (built once per process). If ZSTD fails, the WAL stays uncompressed; if the rest fails, the DB
    is reopened with :func:`db_options`: correct, only slower.
    """
    opts = _load_reopen_options()
    return opts if opts is not None else db_options(create=False)


@functools.cache
def _load_reopen_options() -> rocksdict.Options | None:
    for compression in ("kZSTD", None):
        opts = _patched_options(compression)
        if opts is not None:
            return opts
    return None


def _patched_options(wal_compression: str | None) -> rocksdict.Options | None:
    try:
        with tempfile.TemporaryDirectory(prefix="steward-options-") as tmp:
            db = rocksdict.Rdict(os.path.join(tmp, "db"), db_options(create=True))
            db.close()
            del db
            written = sorted((n for n in os.listdir(os.path.join(tmp, "db")) if n.startswith("OPTIONS-")),
                             key=lambda n: int(n.split("-", 1)[1]))
            with open(os.path.join(tmp, "db", written[-1]), encoding="utf-8") as fh:
                text = fh.read()
            patched, n = re.subn(r"(?m)^(\s*avoid_flush_during_recovery=)false$", r"\1true", text)
            if n != 1:
                raise ValueError("no avoid_flush_during_recovery=false line in RocksDB's OPTIONS file")
            if wal_compression is not None:
                patched, n = re.subn(r"(?m)^(\s*wal_compression=)\w+$", rf"\g<1>{wal_compression}", patched)
                if n != 1:
                    raise ValueError("no wal_compression line in RocksDB's OPTIONS file")
            os.mkdir(os.path.join(tmp, "options"))
            with open(os.path.join(tmp, "options", "OPTIONS-000001"), "w", encoding="utf-8") as fh:
                fh.write(patched)
            opts = rocksdict.Options.load_latest(os.path.join(tmp, "options"))[0]
            opts.create_if_missing(False)
            # try them: write through a reopen, then read back through a plain open
            db = rocksdict.Rdict(os.path.join(tmp, "db"), opts)
            db.put(b"steward-probe", b"x" * 100)
            db.cancel_all_background(True)
            del db
            db = rocksdict.Rdict(os.path.join(tmp, "db"), db_options(create=False))
            ok = db.get(b"steward-probe") == b"x" * 100
            db.close()
            del db
            if not ok:
                raise ValueError("a value written with them did not read back")
        return opts
    except Exception as exc:  # noqa: BLE001 - rocksdict raises a bare Exception
        log.warning("cannot use RocksDB options avoid_flush_during_recovery%s (%s)",
                    f" and wal_compression={wal_compression}" if wal_compression else "", exc)
        return None


def _write_options() -> rocksdict.WriteOptions:
    return rocksdict.WriteOptions()  # WAL on, never synced (sync=False is the default)


def _snapshot_files(db_path: Path) -> list[str]:
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


def _wal_bytes(directory: Path) -> int:
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
    except Exception as exc:  # noqa: BLE001 - rocksdict raises a bare Exception
        raise StateBackendError(f"cannot fold the {wal} B WAL of snapshot {directory} into an SST: {exc}") from exc
    keep = set(_snapshot_files(directory))
    for p in directory.iterdir():
        if p.name not in keep and p.is_file():
            p.unlink()
    return wal


def _open_files_under(path: Path) -> list[str]:
    """Paths under ``path`` this process still has open (Linux ``/proc``; elsewhere nothing known)."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return []
    prefix = str(path.resolve()) + os.sep
    found = []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(prefix):
            found.append(target)
    return found


@dataclass(frozen=True, slots=True)
class LocalSnapshot:
    """A consistent copy of the DB on local disk (the output of the sync phase)."""

    path: Path
    key_groups: KeyGroupRange
    sync_ms: float
    flush_ms: float = 0.0  # the part of sync_ms that flushed the memtable (keep_open snapshots)

    def files(self) -> list[Path]:
        return sorted(p for p in self.path.iterdir() if p.is_file())


class RocksDBStateBackend:
    """The RocksDB of one subtask, for key groups ``key_groups`` of ``max_parallelism``.

    Parameters
    ----------
    directory
        The subtask's working directory; the DB lives in ``directory/db``.
    key_groups, max_parallelism
        What this subtask owns. A key outside ``key_groups`` is refused (a routing bug).
    key_type
        The Spark type of the key column (decides the key bytes, see :mod:`keygroups`).
    create
        ``True`` to create a new, empty DB (the dir must not hold one); ``False`` to open the DB a
        restore put there (its CURRENT must exist; nothing empty is ever created by accident).
    """

    def __init__(self, directory: str | os.PathLike[str], key_groups: KeyGroupRange, max_parallelism: int,
                 key_type: KeyType | str = KeyType.STRING, *, create: bool = True,
                 read_only: bool = False) -> None:
        self.directory = Path(directory)
        self.db_path = self.directory / DB_DIR
        self.key_groups = key_groups
        self.max_parallelism = max_parallelism
        self.key_type = KeyType.parse(key_type)
        self.read_only = read_only
        self._closed = False
        self._iterators: weakref.WeakSet[Iterator[Any]] = weakref.WeakSet()
        exists = (self.db_path / "CURRENT").exists()
        if create and exists:
            raise StateBackendError(f"{self.db_path} already holds a DB; open it with create=False")
        if not create and not exists:
            raise StateBackendError(
                f"{self.db_path} holds no RocksDB (no CURRENT file): restore a checkpoint into it first")
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            if read_only:
                self._db = rocksdict.Rdict(str(self.db_path), db_options(create=False),
                                           access_type=rocksdict.AccessType.read_only())
            else:
                if create:  # created with the raw options rocksdict records, then written with reopen_options
                    db = rocksdict.Rdict(str(self.db_path), db_options(create=True))
                    db.cancel_all_background(True)
                    del db
                self._db = rocksdict.Rdict(str(self.db_path), reopen_options())
                self._db.set_write_options(_write_options())
        except Exception as exc:  # noqa: BLE001 - rocksdict raises a bare Exception
            raise StateBackendError(f"cannot open the state DB in {self.db_path}: {exc}") from exc
        #: bytes of WAL the open replayed (the executor agent folds a snapshot's WAL past
        #: ``wal-flush-size`` into an SST in the async phase, see :func:`fold_wal`)
        self.wal_bytes = _wal_bytes(self.db_path) if not create else 0

    # --- keys --------------------------------------------------------------------------------
    def _key(self, key: object) -> tuple[int, bytes]:
        raw = key_bytes(key, self.key_type)
        group = key_group_of_bytes(raw, self.max_parallelism)
        if group not in self.key_groups:
            raise StateEncodingError(
                f"key {key!r} is in key group {group}, which this subtask does not own "
                f"(it owns {self.key_groups} of {self.max_parallelism}): rows were routed to the wrong subtask")
        return group, raw

    @property
    def db(self) -> rocksdict.Rdict:
        if self._closed:
            raise StateBackendError(f"the state backend of {self.db_path} is closed")
        return self._db

    # --- typed views -------------------------------------------------------------------------
    def value(self, name: str) -> ValueState:
        return ValueState(self, name)

    def map(self, name: str) -> MapState:
        return MapState(self, name)

    def list(self, name: str) -> ListState:
        return ListState(self, name)

    # --- raw access (rescale, read(), the CLI) ------------------------------------------------
    def iter_raw(self, groups: KeyGroupRange | None = None) -> Iterator[tuple[bytes, bytes]]:
        """Every stored ``(key, value)`` in key groups ``groups`` (default: all), in key order.

        Uses an upper bound plus ``seek(lower)``: rocksdict's ``set_iterate_lower_bound`` sets the
        upper bound.
        """
        groups = groups or KeyGroupRange(0, 0x8000)
        lower, upper = group_bounds(groups.start, groups.stop)
        return self._scan(lower, upper, 0)

    def _scan(self, lower: bytes, upper: bytes, strip: int) -> Iterator[tuple[bytes, bytes]]:
        """A bounded scan whose generator the backend tracks, so ``close()`` can end it."""
        gen = _bounded_scan(self.db, lower, upper, strip)
        self._iterators.add(gen)
        return gen

    def delete_outside(self, keep: KeyGroupRange, compact: bool = False) -> None:
        """Drop every key group outside ``keep`` (range tombstones; ``compact`` drops the bytes too)."""
        lo, hi = group_bounds(keep.start, keep.stop)
        if keep.start > 0:
            self.db.delete_range(b"\x00\x00", lo)
        self.db.delete_range(hi, b"\xff\xff\xff")
        if compact:
            opts = rocksdict.CompactOptions()
            opts.set_bottommost_level_compaction(rocksdict.BottommostLevelCompaction.force())
            self.db.compact_range(None, None, opts)

    def ingest(self, paths: Sequence[str | os.PathLike[str]]) -> None:
        """Ingest ``SstFileWriter`` files (written with ``db_options``)."""
        if paths:
            self.db.ingest_external_file([str(p) for p in paths])

    # --- checkpoints -------------------------------------------------------------------------
    def snapshot(self, target: str | os.PathLike[str], *, keep_open: bool = False) -> LocalSnapshot:
        """The sync phase: a consistent local copy of the DB in ``target`` (which must not exist).

        By default the DB is closed without a flush (the batch's writes are in its WAL) and its live
        files are hard-linked into ``target``: nothing is written or fsynced, and a closed directory
        cannot be torn by a compaction. The backend is closed afterwards. ``keep_open=True`` keeps
        the DB open and uses ``Checkpoint.create_checkpoint`` (a memtable flush and fsyncs) instead.
        """
        target = Path(target)
        if target.exists():
            raise StateBackendError(f"snapshot dir {target} already exists; pick a new one per checkpoint")
        target.parent.mkdir(parents=True, exist_ok=True)
        if keep_open or self.read_only:
            return self._checkpoint_snapshot(target)
        if self._closed:
            raise StateBackendError(f"the state backend of {self.db_path} is closed")
        started = time.perf_counter()
        self._shutdown()
        left = _open_files_under(self.db_path)
        if left:
            raise StateBackendError(
                f"cannot snapshot {self.db_path}: the DB is still open after close ({left[0]} and "
                f"{len(left) - 1} more); something outside this backend keeps a handle of it")
        staging = target.with_name(f".{target.name}.{os.getpid()}.linking")
        try:
            staging.mkdir()
            for name in _snapshot_files(self.db_path):
                os.link(self.db_path / name, staging / name)
            os.rename(staging, target)
        except OSError as exc:
            raise StateBackendError(f"cannot snapshot {self.db_path} into {target}: {exc}") from exc
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        ms = (time.perf_counter() - started) * 1000
        log.debug("snapshot of %s into %s took %.1f ms (closed, linked)", self.db_path, target, ms)
        return LocalSnapshot(target, self.key_groups, ms, 0.0)

    def _checkpoint_snapshot(self, target: Path) -> LocalSnapshot:
        started = time.perf_counter()
        # create_checkpoint flushes the memtable itself; flushing first splits the sync phase into the
        # flush (an SST, usually the larger share) and the links and copies
        try:
            self.db.flush(True)
        except Exception as exc:  # noqa: BLE001 - rocksdict raises a bare Exception
            raise StateBackendError(f"cannot flush the state DB in {self.db_path}: {exc}") from exc
        flushed = time.perf_counter()
        chk = rocksdict.Checkpoint(self.db)
        try:
            chk.create_checkpoint(str(target))
        except Exception as exc:  # noqa: BLE001 - rocksdict raises a bare Exception
            raise StateBackendError(f"cannot snapshot {self.db_path} into {target}: {exc}") from exc
        finally:
            del chk  # a live Checkpoint object keeps the DB's LOCK
        ms = (time.perf_counter() - started) * 1000
        flush_ms = (flushed - started) * 1000
        log.debug("snapshot of %s into %s took %.1f ms (flush %.1f ms)", self.db_path, target, ms, flush_ms)
        return LocalSnapshot(target, self.key_groups, ms, flush_ms)

    def _shutdown(self) -> None:
        """Drop the DB without a flush (its WAL holds what the memtable does); releases the LOCK."""
        self._closed = True
        for gen in list(self._iterators):  # an abandoned scan holds a rocksdict iterator, and so the LOCK
            gen.close()
        self._iterators.clear()
        db = self.__dict__.pop("_db", None)
        if db is not None:
            try:
                # stop background work first: rocksdict's close() (and a plain drop) would flush the
                # memtable; a running compaction is abandoned, a running flush finishes
                db.cancel_all_background(True)
            except Exception as exc:  # noqa: BLE001 - rocksdict raises a bare Exception
                log.warning("cannot stop the background work of %s: %s", self.db_path, exc)
            del db

    def close(self) -> None:
        """Close the DB and release its LOCK, without a flush (the WAL keeps the writes). Idempotent."""
        if self._closed:
            return
        self._shutdown()

    def __enter__(self) -> RocksDBStateBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _View:
    kind: bytes

    def __init__(self, backend: RocksDBStateBackend, name: str) -> None:
        # kind + name length + name: the constant middle of every key of this state (validated here)
        self._middle = key_prefix(0, self.kind, name, b"")[2:-4]
        self.backend = backend
        self.name = name

    def _raw_key(self, key: object) -> bytes:
        group, raw = self.backend._key(key)
        return key_prefix(group, self.kind, self.name, raw)

    def _raw_keys(self, keys: list[object]) -> list[bytes]:
        """:meth:`_raw_key` for many keys, with the per-key work inlined (the Arrow path's hot loop)."""
        b = self.backend
        kt, m, lo, hi, middle = b.key_type, b.max_parallelism, b.key_groups.start, b.key_groups.stop, self._middle
        h = xxhash.xxh64_intdigest
        out = []
        append = out.append
        fast = kt is KeyType.STRING
        for k in keys:
            if fast and type(k) is str:
                raw = k.encode("utf-8")
            else:
                raw = key_bytes(k, kt)
            u = h(raw, SPARK_HASH_SEED)
            g = (u - (1 << 64) if u >= 1 << 63 else u) % m
            if not lo <= g < hi:
                b._key(k)  # raises the error naming the key
            append(b"".join((g.to_bytes(2, "big"), middle, len(raw).to_bytes(4, "big"), raw)))
        return out


class ValueState(_View):
    """One value per key."""

    kind = KIND_VALUE

    def get(self, key: object) -> Any:
        return decode_value(self.backend.db.get(self._raw_key(key)))

    def update(self, key: object, value: object) -> None:
        """Set the value; ``None`` clears it."""
        if value is None:
            self.clear(key)
            return
        self.backend.db.put(self._raw_key(key), encode_value(value))

    def clear(self, key: object) -> None:
        self.backend.db.delete(self._raw_key(key))

    def get_many(self, keys: Iterable[object]) -> list[Any]:
        """The values of ``keys`` (``None`` where absent), in one multi-get."""
        raw = self._raw_keys(_as_list(keys))
        if not raw:
            return []
        return [decode_value(v) for v in self.backend.db.get(raw)]

    def put_many(self, keys: Iterable[object], values: Iterable[object]) -> None:
        """Set many values in one WriteBatch; a ``None`` value clears its key."""
        keys, values = _as_list(keys), _as_list(values)
        if len(keys) != len(values):
            raise StateEncodingError(f"put_many got {len(keys)} keys but {len(values)} values")
        wb = rocksdict.WriteBatch(raw_mode=True)
        for rk, v in zip(self._raw_keys(keys), values):
            if v is None:
                wb.delete(rk)
            else:
                wb.put(rk, encode_value(v))
        self.backend.db.write(wb)

    def bind(self, key: object) -> BoundValueState:
        return BoundValueState(self, key)


class BoundValueState:
    """A :class:`ValueState` fixed to one key: what a per-key user function receives."""

    __slots__ = ("_key", "_state")

    def __init__(self, state: ValueState, key: object) -> None:
        self._state = state
        self._key = key

    def get(self) -> Any:
        return self._state.get(self._key)

    def update(self, value: object) -> None:
        self._state.update(self._key, value)

    def clear(self) -> None:
        self._state.clear(self._key)


class MapState(_View):
    """A map per key; map keys and values are encoded like values (so map keys sort by encoded bytes)."""

    kind = KIND_MAP

    def get(self, key: object, map_key: object) -> Any:
        group, raw = self.backend._key(key)
        return decode_value(self.backend.db.get(state_key(group, KIND_MAP, self.name, raw, map_key)))

    def put(self, key: object, map_key: object, value: object) -> None:
        group, raw = self.backend._key(key)
        self.backend.db.put(state_key(group, KIND_MAP, self.name, raw, map_key), encode_value(value))

    def put_all(self, key: object, entries: dict[Any, Any]) -> None:
        group, raw = self.backend._key(key)
        wb = rocksdict.WriteBatch(raw_mode=True)
        for mk, v in entries.items():
            wb.put(state_key(group, KIND_MAP, self.name, raw, mk), encode_value(v))
        self.backend.db.write(wb)

    def remove(self, key: object, map_key: object) -> None:
        group, raw = self.backend._key(key)
        self.backend.db.delete(state_key(group, KIND_MAP, self.name, raw, map_key))

    def _scan(self, key: object) -> Iterator[tuple[bytes, bytes]]:
        prefix = self._raw_key(key)
        return self.backend._scan(prefix, _prefix_upper(prefix), len(prefix))

    def items(self, key: object) -> list[tuple[Any, Any]]:
        return [(decode_value(mk), decode_value(v)) for mk, v in self._scan(key)]

    def keys(self, key: object) -> list[Any]:
        return [decode_value(mk) for mk, _ in self._scan(key)]

    def contains(self, key: object, map_key: object) -> bool:
        return self.get(key, map_key) is not None

    def clear(self, key: object) -> None:
        prefix = self._raw_key(key)
        self.backend.db.delete_range(prefix, _prefix_upper(prefix))

    def bind(self, key: object) -> BoundMapState:
        return BoundMapState(self, key)


class BoundMapState:
    """A :class:`MapState` fixed to one key."""

    __slots__ = ("_key", "_state")

    def __init__(self, state: MapState, key: object) -> None:
        self._state = state
        self._key = key

    def get(self, map_key: object) -> Any:
        return self._state.get(self._key, map_key)

    def put(self, map_key: object, value: object) -> None:
        self._state.put(self._key, map_key, value)

    def remove(self, map_key: object) -> None:
        self._state.remove(self._key, map_key)

    def items(self) -> list[tuple[Any, Any]]:
        return self._state.items(self._key)

    def keys(self) -> list[Any]:
        return self._state.keys(self._key)

    def clear(self) -> None:
        self._state.clear(self._key)


class ListState(_View):
    """A list per key, stored as one JSON list value (cheap to read whole, appends rewrite it)."""

    kind = KIND_LIST

    def get(self, key: object) -> list[Any]:
        return decode_value(self.backend.db.get(self._raw_key(key))) or []

    def add(self, key: object, value: object) -> None:
        self.add_all(key, [value])

    def add_all(self, key: object, values: Iterable[object]) -> None:
        rk = self._raw_key(key)
        current = decode_value(self.backend.db.get(rk)) or []
        self.backend.db.put(rk, encode_value(current + list(values)))

    def update(self, key: object, values: Iterable[object]) -> None:
        values = list(values)
        if values:
            self.backend.db.put(self._raw_key(key), encode_value(values))
        else:
            self.clear(key)

    def clear(self, key: object) -> None:
        self.backend.db.delete(self._raw_key(key))

    def bind(self, key: object) -> BoundListState:
        return BoundListState(self, key)


class BoundListState:
    """A :class:`ListState` fixed to one key."""

    __slots__ = ("_key", "_state")

    def __init__(self, state: ListState, key: object) -> None:
        self._state = state
        self._key = key

    def get(self) -> list[Any]:
        return self._state.get(self._key)

    def add(self, value: object) -> None:
        self._state.add(self._key, value)

    def add_all(self, values: Iterable[object]) -> None:
        self._state.add_all(self._key, values)

    def update(self, values: Iterable[object]) -> None:
        self._state.update(self._key, values)

    def clear(self) -> None:
        self._state.clear(self._key)


def _bounded_scan(db: rocksdict.Rdict, lower: bytes, upper: bytes, strip: int) -> Iterator[tuple[bytes, bytes]]:
    """``(key[strip:], value)`` for keys in ``[lower, upper)``.

    Bounded by ``set_iterate_upper_bound`` plus ``seek(lower)``: rocksdict's
    ``set_iterate_lower_bound`` sets the upper bound.
    """
    ro = rocksdict.ReadOptions()
    ro.set_iterate_upper_bound(upper)
    it = db.iter(ro)
    try:
        it.seek(lower)
        while it.valid():
            yield it.key()[strip:], it.value()
            it.next()
    finally:
        del it


def _prefix_upper(prefix: bytes) -> bytes:
    """The smallest byte string greater than every string that starts with ``prefix``."""
    b = bytearray(prefix)
    while b and b[-1] == 0xFF:
        b.pop()
    if not b:
        return b"\xff" * (len(prefix) + 1)
    b[-1] += 1
    return bytes(b)


def _as_list(values: Iterable[object]) -> list[object]:
    """Accept lists, tuples, numpy arrays, pandas Series and pyarrow Arrays alike."""
    to_pylist = getattr(values, "to_pylist", None)
    if to_pylist is not None:  # pyarrow
        return to_pylist()
    tolist = getattr(values, "tolist", None)
    if tolist is not None:  # numpy, pandas
        return tolist()
    return list(values)
