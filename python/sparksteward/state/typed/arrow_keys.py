"""The RocksDB keys of a column of keys, and their key order: the vectorized paths of the typed views
build every key of a batch at once (string keys by numpy, :func:`keys_of`) and hand bulk reads and
writes to RocksDB in its (bytewise) key order (:func:`key_order`), which costs it less than the
batch's order. Both remember their last answer on the view, so a ``get_many`` then ``put_many`` over
the same keys builds and sorts them once."""

from __future__ import annotations

import functools
import itertools
from typing import Any, Protocol, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import rocksdict
import xxhash

from sparksteward.state.keygroups import SPARK_HASH_SEED, KeyType
from sparksteward.state.rows import rows_array, var_buffers
from sparksteward.state.typed.columns import as_pylist
from sparksteward.state.views import StateDB, _heads, raw_keys, variable_entries

__all__ = ["KeyedView", "get_stored", "key_order", "keys_of", "last_of_equal"]

#: bulk reads and writes of at least this many keys go to RocksDB in key order (:func:`key_order`)
_SORT_FROM = 64
_LEN_BYTES = 4   # the key's length in a RocksDB key (encoding.key_prefix)
#: a bulk read of at least this many keys, for at least 1/_SCAN_RATIO of the entries the DB holds, scans the
#: variable's entries instead of a multi-get (:func:`get_stored`)
_SCAN_FROM = 1024
_SCAN_RATIO = 4


class KeyedView(Protocol):
    """What the functions here need of a typed view (:class:`~sparksteward.state.typed.base.TypedView`):
    its backend, the constant middle of its keys, and the slots where they keep their last answers."""

    backend: StateDB
    _middle: bytes
    _last_keys: tuple[pa.Array, list[bytes]] | None
    _last_order: tuple[list[bytes], np.ndarray] | None
    _last_raw: tuple[list[bytes], pa.Array] | None   # _string_raw_keys' keys as Arrow


def keys_of(view: KeyedView, keys: Any) -> list[bytes]:
    """The RocksDB keys of ``keys``; an Arrow array equal to the previous call's reuses its keys (a
    ``get_many`` then ``put_many`` over the same keys builds them once)."""
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    if isinstance(keys, pa.Array):
        last = view._last_keys
        if last is not None and len(last[0]) == len(keys) and last[0].equals(keys):
            return last[1]
        raw = _string_raw_keys(view, keys)
        if raw is None:
            raw = raw_keys(view.backend, view._middle, keys.to_pylist())
        view._last_keys = (keys, raw)
        return raw
    return raw_keys(view.backend, view._middle, as_pylist(keys))


def key_order(view: KeyedView, raw: list[bytes]) -> np.ndarray | None:
    """The positions of ``raw`` in RocksDB's (bytewise) key order, or None for a few keys. A write batch
    built in key order costs RocksDB a third less than one in the batch's order (the memtable's
    skip-list inserts stay local, the WAL compresses better), and a multi-get in key order a little
    less. A ``get_many`` then ``put_many`` over the same keys sorts them once."""
    if len(raw) < _SORT_FROM:
        return None
    last = view._last_order
    if last is not None and last[0] is raw:
        return last[1]
    order = pc.sort_indices(_raw_array(view, raw)).to_numpy()
    view._last_order = (raw, order)
    return order


def get_stored(view: KeyedView, raw: list[bytes]) -> list[bytes | None]:
    """The stored values at the RocksDB keys ``raw`` of ``view`` (None where absent), in their order.

    A multi-get in key order, except where the keys are many and the DB holds at most
    ``_SCAN_RATIO`` entries per key asked for (RocksDB's estimate, over every variable): then one
    iteration over the view's entries in each key group, looked up in a dict. A lookup of a key costs
    RocksDB about 1.2-1.9 us (the block it sits in found and decompressed again for each), the next
    entry of an iteration about 0.3 us (``bench_state_ceiling.py``'s ``time_state_work``: 15,810 keys of a
    24,823-key subtask, multi-get 30-33 ms, iteration and lookups 21 ms). Both read the same DB at the
    same moment; a per-key run's buffered store (its writes not in the DB yet) always takes the multi-get."""
    store = view.backend.store
    n = len(raw)
    if n >= _SCAN_FROM and isinstance(store, rocksdict.Rdict):
        held = store.property_int_value("rocksdb.estimate-num-keys")
        if held is not None and held <= n * _SCAN_RATIO:
            found = _scan(view, store, n * _SCAN_RATIO)
            if found is not None:
                get = found.get
                return [get(k) for k in raw]
    order = key_order(view, raw)
    if order is None:
        return cast("list[bytes | None]", store.get(cast("list[Any]", raw)))
    got = np.empty(n, dtype=object)   # read in key order, then put back in the keys' order
    got[order] = store.get([raw[i] for i in order.tolist()])
    return cast("list[bytes | None]", got.tolist())


def _scan(view: KeyedView, store: rocksdict.Rdict, budget: int) -> dict[bytes, bytes] | None:
    """Every entry of ``view``'s variable in its backend's key groups, or None once more than ``budget``
    of them turned up (RocksDB's estimate counts a key less for each delete it has not compacted away, so
    it can be far below what the DB holds: then the multi-get runs after at most ``budget`` entries read)."""
    found: dict[bytes, bytes] = {}
    for entries in variable_entries(store, view.backend.key_groups, view._middle):
        found.update(itertools.islice(entries, budget - len(found) + 1))
        if len(found) > budget:
            return None
    return found


def _raw_array(view: KeyedView, raw: list[bytes]) -> pa.Array:
    """``raw`` as an Arrow binary array: the one :func:`_string_raw_keys` built them from, if it did."""
    built = view._last_raw
    return built[1] if built is not None and built[0] is raw else pa.array(raw, pa.binary())


def last_of_equal(view: KeyedView, raw: list[bytes], order: np.ndarray) -> list[int]:
    """The positions of :func:`key_order`'s ``order`` without all but the last of equal keys (the
    sort is stable, so equal keys sit together in the callers' order)."""
    in_order = _raw_array(view, raw).take(pa.array(order))
    if len(in_order) < 2:
        return cast("list[int]", order.tolist())
    repeated = np.asarray(pc.equal(in_order.slice(0, len(in_order) - 1), in_order.slice(1)))
    return cast("list[int]", order[np.append(~repeated, True)].tolist())


def _string_raw_keys(view: KeyedView, keys: pa.Array) -> list[bytes] | None:
    """:func:`~sparksteward.state.views.raw_keys` of an Arrow string array of a string-keyed state,
    with the key groups computed by numpy over the hashes and the keys joined by numpy into one buffer
    (None for any other key or array type). Leaves the keys as an Arrow array in ``view._last_raw``
    for :func:`key_order`."""
    b = view.backend
    if b.key_type is not KeyType.STRING or not (pa.types.is_string(keys.type) or pa.types.is_large_string(keys.type)):
        return None
    if keys.null_count:
        return None   # the per-key path names the null key
    binary = keys.cast(pa.large_binary() if pa.types.is_large_string(keys.type) else pa.binary())
    hashes = np.fromiter(map(xxhash.xxh64_intdigest, binary.to_pylist(), itertools.repeat(SPARK_HASH_SEED)),
                         dtype=np.uint64, count=len(binary))
    groups = hashes.view(np.int64) % b.max_parallelism   # pmod of the signed hash, as Spark SQL
    lo, hi = b.key_groups.start, b.key_groups.stop
    outside = np.flatnonzero((groups < lo) | (groups >= hi))
    if len(outside):
        b.owned_key(keys[int(outside[0])].as_py())   # raises the error naming the key
    heads = _head_matrix(b.max_parallelism, view._middle)
    offsets, data = var_buffers(binary)
    n, h = len(binary), heads.shape[1] + _LEN_BYTES
    lengths = np.diff(offsets)
    if n and int(lengths.min()) == int(lengths.max()):   # keys of one length: a matrix, a row each
        row = np.empty((n, h + int(lengths[0])), dtype=np.uint8)
        row[:, :h - _LEN_BYTES] = heads[groups]
        row[:, h - _LEN_BYTES:h] = np.array([lengths[0]], dtype=">u4").view(np.uint8)
        row[:, h:] = data.reshape(n, int(lengths[0]))
        flat, starts = row.reshape(-1), np.arange(n + 1, dtype=np.int64) * row.shape[1]
    else:
        starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(h + lengths, out=starts[1:])
        flat = np.empty(int(starts[-1]), dtype=np.uint8)
        prefix = np.empty((n, h), dtype=np.uint8)
        prefix[:, :h - _LEN_BYTES] = heads[groups]
        prefix[:, h - _LEN_BYTES:] = lengths.astype(">u4").view(np.uint8).reshape(n, _LEN_BYTES)
        flat[starts[:-1, None] + np.arange(h)] = prefix
        flat[np.arange(len(data)) + np.repeat(starts[:-1] + h - offsets[:-1], lengths)] = data
    arr = rows_array(flat, starts)
    raw: list[bytes] = arr.to_pylist()
    view._last_raw = (raw, arr)
    return raw


@functools.cache
def _head_matrix(max_parallelism: int, middle: bytes) -> np.ndarray:
    """:func:`~sparksteward.state.views._heads` as a matrix, a row per key group."""
    return np.frombuffer(b"".join(_heads(max_parallelism, middle)), dtype=np.uint8).reshape(max_parallelism, -1)

