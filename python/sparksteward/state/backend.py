"""The task-side keyed state backend of one subtask: a local RocksDB (through rocksdict).

A :class:`RocksDBStateBackend` owns one working directory ``<dir>/db`` for the key groups of one
subtask. State is reached through the typed views of :mod:`sparksteward.state.views`:

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
an SST (:func:`sparksteward.state.snapshot.fold_wal`), so WAL files stay a short changelog on top of the SSTs. ``snapshot(keep_open=True)``
is ``Checkpoint.create_checkpoint`` (a memtable flush plus about six fsyncs) for a DB that stays open.
The async phase (upload) runs elsewhere, on the returned :class:`~sparksteward.state.snapshot.LocalSnapshot`.

Not thread-safe: one task thread uses one backend. ``close()`` releases RocksDB's LOCK without a flush;
it first drops every iterator and Checkpoint object the backend made, because rocksdict keeps the LOCK
while any of them is alive.
"""

from __future__ import annotations

import builtins
import itertools
import logging
import os
import shutil
import time
import weakref
from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import rocksdict

from sparksteward.errors import StateBackendError, StateEncodingError
from sparksteward.state.buffered import BufferedStore, Ops
from sparksteward.state.encoding import group_bounds
from sparksteward.state.keygroups import KeyGroupRange, KeyType, key_bytes, key_group_of_bytes
from sparksteward.state.rocksdb_options import db_options, open_db, reopen_options, write_options
from sparksteward.state.snapshot import LocalSnapshot, snapshot_files, wal_bytes
from sparksteward.state.views import ListState, MapState, ValueState
from sparksteward.wire.messages import MAX_PARALLELISM

__all__ = ["DB_DIR", "RocksDBStateBackend"]

log = logging.getLogger("sparksteward.state.backend")

DB_DIR = "db"
_INGESTS = itertools.count()   # names of the SSTs ingest_sorted writes


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
                 read_only: bool = False, flush_wal_above: int | None = None) -> None:
        self.directory = Path(directory)
        self.db_path = self.directory / DB_DIR
        self.key_groups = key_groups
        self.max_parallelism = max_parallelism
        self.key_type = KeyType.parse(key_type)
        self.read_only = read_only
        self.flush_wal_above = flush_wal_above
        self._closed = False
        #: entries this open put in as ingested SSTs (:meth:`ingest_sorted`, decision 0023)
        self.entries_ingested = 0
        self._buffered: BufferedStore | None = None
        self._iterators: weakref.WeakSet[Generator[Any, None, None]] = weakref.WeakSet()
        exists = (self.db_path / "CURRENT").exists()
        if create and exists:
            raise StateBackendError(f"{self.db_path} already holds a DB; open it with create=False")
        if not create and not exists:
            raise StateBackendError(
                f"{self.db_path} holds no RocksDB (no CURRENT file): restore a checkpoint into it first")
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            if read_only:
                self._db = open_db(self.db_path, db_options(create=False), read_only=True)
            else:
                if create:  # created with the raw options rocksdict records, then written with reopen_options
                    db = open_db(self.db_path, db_options(create=True))
                    db.cancel_all_background(True)
                    del db
                self._db = open_db(self.db_path, reopen_options())
                self._db.set_write_options(write_options())
        except Exception as exc:  # rocksdict raises a bare Exception
            raise StateBackendError(f"cannot open the state DB in {self.db_path}: {exc}") from exc
        #: bytes of WAL the open replayed (the executor agent folds a snapshot's WAL past
        #: ``wal-flush-size`` into an SST in the async phase, see :func:`~sparksteward.state.snapshot.fold_wal`)
        self.wal_bytes = wal_bytes(self.db_path) if not create else 0

    # --- keys --------------------------------------------------------------------------------
    def owned_key(self, key: object) -> tuple[int, bytes]:
        """The key group and the encoded bytes of ``key``; StateEncodingError naming the key if this
        subtask does not own its key group (the row was routed to the wrong subtask)."""
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

    @property
    def store(self) -> Any:
        """What the views read and write: the DB, or the :class:`BufferedStore` of a per-key run."""
        return self._buffered if self._buffered is not None else self.db

    def new_batch(self) -> Any:
        """A write batch for :attr:`store` (``store.write(batch)`` applies it)."""
        return Ops() if self._buffered is not None else rocksdict.WriteBatch(raw_mode=True)

    @contextmanager
    def buffered(self, flush_bytes: int = 32 << 20) -> Iterator[BufferedStore]:
        """Buffer the views' writes in one write batch (see :mod:`sparksteward.state.buffered`),
        written when the block ends without an error; the caller calls ``next_key()`` per key."""
        if self._buffered is not None:
            raise StateBackendError(f"the state backend of {self.db_path} is already buffering its writes")
        store = self._buffered = BufferedStore(self.db, flush_bytes)
        try:
            yield store
            store.flush()
        finally:
            self._buffered = None

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
        groups = groups or KeyGroupRange(0, MAX_PARALLELISM)
        lower, upper = group_bounds(groups.start, groups.stop)
        return self.scan(lower, upper, 0)

    def scan(self, lower: bytes, upper: bytes, strip: int) -> Iterator[tuple[bytes, bytes]]:
        """Every stored ``(key, value)`` with ``lower <= key < upper``, in key order, each key without
        its first ``strip`` bytes; the writes of a :meth:`buffered` run are merged in. The backend
        tracks the generator, so ``close()`` can end it."""
        if self._buffered is not None:   # the current key's writes, merged in
            base = _bounded_scan(self.db, lower, upper, 0)
            self._iterators.add(base)
            return self._buffered.scan(base, lower, upper, strip)
        gen = _bounded_scan(self.db, lower, upper, strip)
        self._iterators.add(gen)
        return gen

    def keys_between(self, lower: bytes, upper: bytes) -> builtins.list[bytes]:
        """Every stored key with ``lower <= key < upper``, in key order, in one call (no buffered run
        may be open: its writes would not be seen)."""
        if self._buffered is not None:
            raise StateBackendError("keys_between() sees only what is written: not inside a buffered run")
        ro = rocksdict.ReadOptions()
        ro.set_iterate_upper_bound(upper)
        return list(cast(Iterator[bytes], self.db.keys(from_key=lower, read_opt=ro)))

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

    def ingest(self, paths: Sequence[str | os.PathLike[str]], *, move: bool = False) -> None:
        """Ingest ``SstFileWriter`` files (written with ``db_options``); ``move`` hard-links them in
        instead of copying them."""
        if paths:
            opts = rocksdict.IngestExternalFileOptions()
            opts.set_move_files(move)
            self.db.ingest_external_file([str(p) for p in paths], opts)

    def wants_sst(self, raw_bytes: int) -> bool:
        """Whether sorted puts of ``raw_bytes`` (keys and values) go in faster as an ingested SST
        (:meth:`ingest_sorted`, decision 0023) than through the memtable and the WAL: in a task that
        flushes past ``flush_wal_above`` (decision 0022), for puts that would pass it on their own
        (the WAL is ZSTD, about a fourth of the raw bytes), while the memtable is empty (else RocksDB
        flushes it first into an SST of its own)."""
        if self.flush_wal_above is None or self.read_only or self._buffered is not None:
            return False
        if raw_bytes < 4 * max(self.flush_wal_above, 1):
            return False
        db = self.db
        return not (db.property_int_value("rocksdb.num-entries-active-mem-table")
                    or db.property_int_value("rocksdb.num-immutable-mem-table"))

    def ingest_sorted(self, keys: Sequence[bytes], values: Sequence[bytes]) -> None:
        """Put ``values[i]`` at ``keys[i]``, the keys strictly increasing, as one SST written here and
        ingested into the DB (moved, not copied): no memtable, no WAL and no flush at the sync phase.
        The SST goes to L0 with a sequence number above every write before it, so it reads as a
        write batch of the same puts would. See :meth:`wants_sst`."""
        if not keys:
            return
        path = self.directory / f".ingest-{os.getpid()}-{next(_INGESTS)}.sst"
        try:
            writer = rocksdict.SstFileWriter(options=db_options(create=False))
            writer.open(str(path))
            for k, v in zip(keys, values, strict=True):
                writer[k] = v
            writer.finish()
            self.ingest([path], move=True)
            self.entries_ingested += len(keys)
        except Exception as exc:  # rocksdict raises a bare Exception
            raise StateBackendError(f"cannot write {len(keys)} entries into the state DB in {self.db_path} "
                                    f"as an SST: {exc}") from exc
        finally:
            path.unlink(missing_ok=True)   # moved in or not, nothing stays beside the DB

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
        flush_ms = 0.0
        if self.flush_wal_above is not None and wal_bytes(self.db_path) > self.flush_wal_above:
            # decision 0022: the memtable holds the WAL's writes, so an SST from it costs less than the
            # agent's fold (a replay, then the same flush) and spares the next open its replay
            try:
                self._db.flush(True)
            except Exception as exc:  # rocksdict raises a bare Exception
                raise StateBackendError(f"cannot flush the state DB in {self.db_path}: {exc}") from exc
            flush_ms = (time.perf_counter() - started) * 1000
        self._shutdown()
        left = _open_files_under(self.db_path)
        if left:
            raise StateBackendError(
                f"cannot snapshot {self.db_path}: the DB is still open after close ({left[0]} and "
                f"{len(left) - 1} more); something outside this backend keeps a handle of it")
        staging = target.with_name(f".{target.name}.{os.getpid()}.linking")
        try:
            staging.mkdir()
            for name in snapshot_files(self.db_path):
                os.link(self.db_path / name, staging / name)
            os.rename(staging, target)
        except OSError as exc:
            raise StateBackendError(f"cannot snapshot {self.db_path} into {target}: {exc}") from exc
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        ms = (time.perf_counter() - started) * 1000
        log.debug("snapshot of %s into %s took %.1f ms (flush %.1f ms, closed, linked)", self.db_path, target, ms,
                  flush_ms)
        return LocalSnapshot(target, self.key_groups, ms, flush_ms)

    def _checkpoint_snapshot(self, target: Path) -> LocalSnapshot:
        started = time.perf_counter()
        # create_checkpoint flushes the memtable itself; flushing first splits the sync phase into the
        # flush (an SST, usually the larger share) and the links and copies
        try:
            self.db.flush(True)
        except Exception as exc:  # rocksdict raises a bare Exception
            raise StateBackendError(f"cannot flush the state DB in {self.db_path}: {exc}") from exc
        flushed = time.perf_counter()
        chk = rocksdict.Checkpoint(self.db)
        try:
            chk.create_checkpoint(str(target))
        except Exception as exc:  # rocksdict raises a bare Exception
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


def _bounded_scan(db: rocksdict.Rdict, lower: bytes, upper: bytes,
                  strip: int) -> Generator[tuple[bytes, bytes], None, None]:
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
