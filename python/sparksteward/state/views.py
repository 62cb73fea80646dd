"""The typed views of a keyed-state backend, one per kind of state variable: :class:`ValueState`,
:class:`MapState` and :class:`ListState`, each also bound to a current key (:class:`BoundValueState`
and the others) for the per-key user API. Keys and values are encoded by
:mod:`sparksteward.state.encoding`; the views reach the DB only through their backend."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol, cast

import rocksdict
import xxhash

from sparksteward.errors import StateEncodingError
from sparksteward.state.encoding import (
    KIND_LIST,
    KIND_MAP,
    KIND_VALUE,
    decode_value,
    encode_value,
    key_prefix,
    state_key,
)
from sparksteward.state.keygroups import SPARK_HASH_SEED, KeyGroupRange, KeyType, key_bytes

__all__ = ["BoundListState", "BoundMapState", "BoundValueState", "ListState", "MapState", "StateDB", "ValueState",
           "raw_keys", "state_middle", "variable_entries"]


class StateDB(Protocol):
    """What a view needs of its backend (:class:`~sparksteward.state.backend.RocksDBStateBackend`)."""

    key_type: KeyType
    max_parallelism: int
    key_groups: KeyGroupRange

    @property
    def db(self) -> rocksdict.Rdict: ...

    @property
    def store(self) -> Any: ...

    def new_batch(self) -> Any: ...

    def wants_sst(self, raw_bytes: int) -> bool: ...

    def ingest_sorted(self, keys: Sequence[bytes], values: Sequence[bytes]) -> None: ...

    def owned_key(self, key: object) -> tuple[int, bytes]: ...

    def scan(self, lower: bytes, upper: bytes, strip: int) -> Iterator[tuple[bytes, bytes]]: ...


class _View:
    kind: bytes

    def __init__(self, backend: StateDB, name: str) -> None:
        self._middle = state_middle(self.kind, name)
        self.backend = backend
        self.name = name

    def _raw_key(self, key: object) -> bytes:
        group, raw = self.backend.owned_key(key)
        return key_prefix(group, self.kind, self.name, raw)

    def _raw_keys(self, keys: list[object]) -> list[bytes]:
        return raw_keys(self.backend, self._middle, keys)


def state_middle(kind: bytes, name: str) -> bytes:
    """Kind + name length + name: the constant middle of every key of one state (validated here)."""
    return key_prefix(0, kind, name, b"")[2:-4]


def raw_keys(b: StateDB, middle: bytes, keys: list[object]) -> list[bytes]:
    """The RocksDB keys of ``keys`` in the state whose :func:`state_middle` is ``middle``, with the
    per-key work inlined (the vectorized paths' hot loop)."""
    kt, m, lo, hi = b.key_type, b.max_parallelism, b.key_groups.start, b.key_groups.stop
    h = xxhash.xxh64_intdigest
    heads = _heads(m, middle)
    lengths: dict[int, bytes] = {}
    out: list[bytes] = []
    append = out.append
    fast = kt is KeyType.STRING
    for k in keys:
        raw = k.encode("utf-8") if fast and type(k) is str else key_bytes(k, kt)
        u = h(raw, SPARK_HASH_SEED)
        g = (u - (1 << 64) if u >= 1 << 63 else u) % m
        if not lo <= g < hi:
            b.owned_key(k)  # raises the error naming the key
        n = len(raw)
        ln = lengths.get(n)
        if ln is None:
            ln = lengths[n] = n.to_bytes(4, "big")
        append(heads[g] + ln + raw)
    return out


@functools.lru_cache(maxsize=64)
def _heads(max_parallelism: int, middle: bytes) -> list[bytes]:
    """Key group + middle, the start of every key of one state, per key group."""
    return [g.to_bytes(2, "big") + middle for g in range(max_parallelism)]


class ValueState(_View):
    """One value per key."""

    kind = KIND_VALUE

    def get(self, key: object) -> Any:
        return decode_value(self.backend.store.get(self._raw_key(key)))

    def update(self, key: object, value: object) -> None:
        """Set the value; ``None`` clears it."""
        if value is None:
            self.clear(key)
            return
        self.backend.store.put(self._raw_key(key), encode_value(value))

    def clear(self, key: object) -> None:
        self.backend.store.delete(self._raw_key(key))

    def get_many(self, keys: Iterable[object]) -> list[Any]:
        """The values of ``keys`` (``None`` where absent), in one multi-get."""
        raw = self._raw_keys(_as_list(keys))
        if not raw:
            return []
        # a list of keys is a multi-get, answered by a list (rocksdict's stub: an invariant List in, Any | None out)
        values = cast("list[bytes | None]", self.backend.store.get(cast("list[Any]", raw)))
        return [decode_value(v) for v in values]

    def put_many(self, keys: Iterable[object], values: Iterable[object]) -> None:
        """Set many values in one WriteBatch; a ``None`` value clears its key."""
        keys, values = _as_list(keys), _as_list(values)
        if len(keys) != len(values):
            raise StateEncodingError(f"put_many got {len(keys)} keys but {len(values)} values")
        wb = self.backend.new_batch()
        for rk, v in zip(self._raw_keys(keys), values):
            if v is None:
                wb.delete(rk)
            else:
                wb.put(rk, encode_value(v))
        self.backend.store.write(wb)

    def bind(self, key: object) -> BoundValueState:
        return BoundValueState(self, key)


class KeyedValue(Protocol):
    """A value state by key: :class:`ValueState`, or a declared one's typed view."""

    def get(self, key: object) -> Any: ...

    def update(self, key: object, value: Any) -> None: ...

    def clear(self, key: object) -> None: ...


class BoundValueState:
    """A value state (:class:`KeyedValue`) fixed to one key: what a per-key user function receives."""

    __slots__ = ("_key", "_state")

    def __init__(self, state: KeyedValue, key: object) -> None:
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
        group, raw = self.backend.owned_key(key)
        return decode_value(self.backend.store.get(state_key(group, KIND_MAP, self.name, raw, map_key)))

    def put(self, key: object, map_key: object, value: object) -> None:
        group, raw = self.backend.owned_key(key)
        self.backend.store.put(state_key(group, KIND_MAP, self.name, raw, map_key), encode_value(value))

    def put_all(self, key: object, entries: dict[Any, Any]) -> None:
        group, raw = self.backend.owned_key(key)
        wb = self.backend.new_batch()
        for mk, v in entries.items():
            wb.put(state_key(group, KIND_MAP, self.name, raw, mk), encode_value(v))
        self.backend.store.write(wb)

    def remove(self, key: object, map_key: object) -> None:
        group, raw = self.backend.owned_key(key)
        self.backend.store.delete(state_key(group, KIND_MAP, self.name, raw, map_key))

    def _scan(self, key: object) -> Iterator[tuple[bytes, bytes]]:
        prefix = self._raw_key(key)
        return self.backend.scan(prefix, _prefix_upper(prefix), len(prefix))

    def items(self, key: object) -> list[tuple[Any, Any]]:
        return [(decode_value(mk), decode_value(v)) for mk, v in self._scan(key)]

    def keys(self, key: object) -> list[Any]:
        return [decode_value(mk) for mk, _ in self._scan(key)]

    def contains(self, key: object, map_key: object) -> bool:
        return self.get(key, map_key) is not None

    def clear(self, key: object) -> None:
        prefix = self._raw_key(key)
        self.backend.store.delete_range(prefix, _prefix_upper(prefix))

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
        return decode_value(self.backend.store.get(self._raw_key(key))) or []

    def add(self, key: object, value: object) -> None:
        self.add_all(key, [value])

    def add_all(self, key: object, values: Iterable[object]) -> None:
        rk = self._raw_key(key)
        current = decode_value(self.backend.store.get(rk)) or []
        self.backend.store.put(rk, encode_value(current + list(values)))

    def update(self, key: object, values: Iterable[object]) -> None:
        values = list(values)
        if values:
            self.backend.store.put(self._raw_key(key), encode_value(values))
        else:
            self.clear(key)

    def clear(self, key: object) -> None:
        self.backend.store.delete(self._raw_key(key))

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


def variable_entries(db: rocksdict.Rdict, groups: KeyGroupRange, middle: bytes) -> Iterator[Iterable[tuple[bytes, bytes]]]:
    """The stored ``(key, value)`` entries of the variable whose keys carry ``middle``
    (:func:`state_middle`), one iterator per key group of ``groups``, in key order (only what is in
    ``db``: never a buffered run's writes)."""
    for g in range(groups.start, groups.stop):
        lower = g.to_bytes(2, "big") + middle
        bound = rocksdict.ReadOptions()
        bound.set_iterate_upper_bound(_prefix_upper(lower))
        yield cast("Iterable[tuple[bytes, bytes]]", db.items(from_key=lower, read_opt=bound))


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
