"""The task-side keyed state backend of one subtask: a local RocksDB (through rocksdict).

A :class:`RocksDBStateBackend` owns one working directory ``<dir>/db`` for the key groups of one
subtask. State is reached through typed views:

- :class:`ValueState` (``get``/``update``/``clear``, plus vectorized ``get_many``/``put_many``),
- :class:`MapState` (``get``/``put``/``remove``/``items``/``clear`` for one key),
- :class:`ListState` (``get``/``add``/``add_all``/``update``/``clear``; the list is one value),

each also bindable to a current key (:meth:`ValueState.bind`) for the per-key user API. Keys and values
are encoded by :mod:`sparksteward.state.encoding`. Writes go with the WAL off (a checkpoint, not the
WAL, is what makes state durable) and ``put_many`` uses one ``WriteBatch``.

:meth:`RocksDBStateBackend.snapshot` is the sync phase of a checkpoint: ``Checkpoint.create_checkpoint``
into a new local directory (hard links plus a consistent MANIFEST), which takes milliseconds. The async
phase (upload) runs elsewhere, on the returned :class:`LocalSnapshot`.

Not thread-safe: one task thread uses one backend. ``close()`` releases RocksDB's LOCK; it first drops
every iterator and Checkpoint object the backend made, because rocksdict keeps the LOCK while any of
them is alive.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import rocksdict
import xxhash

from sparksteward.errors import StateBackendError, StateEncodingError
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
           "RocksDBStateBackend", "ValueState", "db_options"]

log = logging.getLogger("sparksteward.state.backend")

DB_DIR = "db"


def db_options(*, create: bool) -> rocksdict.Options:
    """The options every keyed-state DB is opened with (raw byte keys; create only when new)."""
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(create)
    return opts


def _write_options() -> rocksdict.WriteOptions:
    wo = rocksdict.WriteOptions()
    wo.disable_wal = True
    return wo


@dataclass(frozen=True, slots=True)
class LocalSnapshot:
    """A consistent copy of the DB on local disk (the output of the sync phase)."""

    path: Path
    key_groups: KeyGroupRange
    sync_ms: float

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
                self._db = rocksdict.Rdict(str(self.db_path), db_options(create=create))
                self._db.set_write_options(_write_options())
        except Exception as exc:  # noqa: BLE001 - rocksdict raises a bare Exception
            raise StateBackendError(f"cannot open the state DB in {self.db_path}: {exc}") from exc

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

    def write_raw(self, items: Iterable[tuple[bytes, bytes]]) -> int:
        wb = rocksdict.WriteBatch(raw_mode=True)
        n = 0
        for k, v in items:
            wb.put(k, v)
            n += 1
        self.db.write(wb)
        return n

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
    def snapshot(self, target: str | os.PathLike[str]) -> LocalSnapshot:
        """The sync phase: a consistent local copy of the DB in ``target`` (which must not exist)."""
        target = Path(target)
        if target.exists():
            raise StateBackendError(f"snapshot dir {target} already exists; pick a new one per checkpoint")
        target.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        chk = rocksdict.Checkpoint(self.db)
        try:
            chk.create_checkpoint(str(target))
        except Exception as exc:  # noqa: BLE001 - rocksdict raises a bare Exception
            raise StateBackendError(f"cannot snapshot {self.db_path} into {target}: {exc}") from exc
        finally:
            del chk  # a live Checkpoint object keeps the DB's LOCK
        ms = (time.perf_counter() - started) * 1000
        log.debug("snapshot of %s into %s took %.1f ms", self.db_path, target, ms)
        return LocalSnapshot(target, self.key_groups, ms)

    def close(self) -> None:
        """Close the DB and release its LOCK. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for gen in list(self._iterators):  # an abandoned scan holds a rocksdict iterator, and so the LOCK
            gen.close()
        self._iterators.clear()
        try:
            self._db.close()
        except Exception as exc:  # noqa: BLE001
            raise StateBackendError(f"cannot close the state DB in {self.db_path}: {exc}") from exc
        finally:
            del self._db

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
