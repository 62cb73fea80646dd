"""The views of declared state variables (decision 0017): typed value, list and map states with TTL,
each in a vectorized form (over many keys at once, Arrow in and out) and bound to one key (the per-key
form). :class:`TypedStates` holds the declared variables of one subtask's backend at one batch's
processing time.

**Layout.** A value is one RocksDB entry at the key of :mod:`sparksteward.state.encoding` (kind ``v``).
A list element is its own entry: the list's key plus an 8-byte big-endian sequence,
``(batch << 32) | n`` with ``n`` counting this subtask's appends in the batch, so appends need no read
and a scan returns the elements in order. A map entry is its own entry: the map's key plus the map
key, encoded as a typed value of the declared key type. So an append, a put and a get of one entry
cost the same whatever the size of the list or map.

**TTL.** A value, element or entry of a variable with a TTL carries its expiry in its header
(:data:`~sparksteward.state.rows.TAG_EXPIRING`); a read never returns an expired one. Each such write
also puts an index key ``group | 'x' | expiry (8, big-endian) | the entry's key without its group``
with an empty value, so :func:`sweep_expired` finds what expired in key order, without a scan of the
state. An index key whose entry was written again later is stale; the sweep deletes it alone.

**Dropped values.** A typed value of a version below the variable's first
(:class:`~sparksteward.state.declared.VariableRecord`) belongs to a dropped variable of the same name
whose drop has not run yet: every read leaves it out. :func:`drop_variables` deletes a variable's
entries and its expiry-index keys.

**Old values.** JSON values an untyped view wrote under the same name (the named states before
declarations) are read and converted to the declared type; a JSON list stored whole is read as the
list's first elements.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import rocksdict
import xxhash

from sparksteward.errors import StateEncodingError, StateError
from sparksteward.state.declared import VariableRecord, variables_of
from sparksteward.state.encoding import KIND_LIST, KIND_MAP, KIND_VALUE, decode_value, key_prefix
from sparksteward.state.keygroups import SPARK_HASH_SEED, KeyType
from sparksteward.state.rows import (
    TAG_EXPIRING,
    TAG_TYPED,
    RowCodec,
    expired,
    expiry_of,
    project_py,
    rows_array,
    var_buffers,
    with_expiry,
)
from sparksteward.state.views import StateDB, _heads, _prefix_upper, raw_keys, state_middle

__all__ = ["KIND_EXPIRY", "SweepStats", "index_expiry", "index_key", "TypedList", "TypedMap", "TypedStates", "TypedValue", "drop_variables",
           "sweep_expired"]

KIND_EXPIRY = b"x"
_EXPIRY_LEN = 8
#: bulk reads and writes of at least this many keys go to RocksDB in key order (:func:`_key_order`)
_SORT_FROM = 64
_LEN_BYTES = 4   # the key's length in a RocksDB key (encoding.key_prefix)


def index_key(entry: bytes, expiry: int) -> bytes:
    """The expiry-index key of entry key ``entry`` expiring at ``expiry`` ms (same key group)."""
    return b"".join((entry[:2], KIND_EXPIRY, expiry.to_bytes(_EXPIRY_LEN, "big"), entry[2:]))


def index_expiry(key: bytes) -> int:
    """The expiry an expiry-index key records."""
    return int.from_bytes(key[3:3 + _EXPIRY_LEN], "big")


class TypedStates:
    """The declared variables of one subtask at one batch: ``record`` is the state's declarations
    (``properties.states``), ``now_ms`` the batch's processing time, ``batch`` its checkpoint id."""

    def __init__(self, backend: StateDB, record: Mapping[str, Any] | None, now_ms: int, batch: int) -> None:
        self.backend = backend
        self.variables = variables_of(record)
        self.now_ms = int(now_ms)
        self.batch = int(batch)
        if not 0 <= self.batch < 1 << 31:
            raise StateError(f"batch {batch} is out of range for list state sequences")
        self._appends = 0
        self._views: dict[str, _Typed] = {}

    def next_seq(self, n: int = 1) -> int:
        """The first of ``n`` fresh list sequence numbers of this batch."""
        first = self._appends
        self._appends += n
        if self._appends >= 1 << 32:
            raise StateError(f"more than 2**32 list appends in one batch of one subtask (batch {self.batch})")
        return (self.batch << 32) | first

    def _view(self, name: str, kind: str) -> Any:
        got = self._views.get(name)
        if got is None:
            var = self.variables.get(name)
            if var is None:
                known = ", ".join(f"{n} ({v.spec.kind})" for n, v in sorted(self.variables.items())) or "none"
                raise StateError(f"state variable {name!r} is not declared; declared: {known}. Declare it with "
                                 f"states=[...] when opening the keyed state")
            cls: type[_Typed] = {"value": TypedValue, "list": TypedList, "map": TypedMap}[var.spec.kind]
            got = self._views[name] = cls(self, var)
        if got.var.spec.kind != kind:
            raise StateError(f"state variable {name!r} is a {got.var.spec.kind} state, not a {kind} state: use "
                             f"state.{got.var.spec.kind}({name!r})")
        return got

    def value(self, name: str) -> TypedValue:
        return cast(TypedValue, self._view(name, "value"))

    def list(self, name: str) -> TypedList:
        return cast(TypedList, self._view(name, "list"))

    def map(self, name: str) -> TypedMap:
        return cast(TypedMap, self._view(name, "map"))


class _Typed:
    kind: bytes

    def __init__(self, states: TypedStates, var: VariableRecord) -> None:
        self.states = states
        self.var = var
        self.name = var.spec.name
        self.backend = states.backend
        self.ttl = var.spec.ttl_ms
        self.on_read = var.spec.ttl_update == "on_read_and_write" and self.ttl is not None
        self._middle = state_middle(self.kind, self.name)
        self._last_keys: tuple[pa.Array, list[bytes]] | None = None
        self._last_order: tuple[list[bytes], np.ndarray] | None = None
        self._last_raw: tuple[list[bytes], pa.Array] | None = None   # _string_raw_keys' keys as Arrow
        self._last_prefix: tuple[object, bytes] | None = None
        self.codec = var.codec()
        self._codecs: dict[tuple[int, int], RowCodec] = {(self.codec.tag, var.version): self.codec}
        self._first = var.first   # typed values of older versions are a dropped variable's (see _dropped)

    # --- keys and writes --------------------------------------------------------------------------
    def _prefix(self, key: object) -> bytes:
        last = self._last_prefix
        if last is not None and last[0] is key:   # the per-key form's bound key, again
            return last[1]
        group, raw = self.backend._key(key)
        prefix = key_prefix(group, self.kind, self.name, raw)
        if type(key) is not bytearray:   # a key that cannot change under the same object
            self._last_prefix = (key, prefix)
        return prefix

    @property
    def _expiry(self) -> int | None:
        return None if self.ttl is None else self.states.now_ms + self.ttl

    def _put(self, db: Any, k: bytes, stored: bytes, expiry: int | None) -> None:
        db.put(k, stored)
        if expiry is not None:
            db.put(index_key(k, expiry), b"")

    # --- decoding ---------------------------------------------------------------------------------
    def _codec_of(self, tag: int, version: int) -> RowCodec:
        c = self._codecs.get((tag, version))
        if c is None:
            c = self._codecs[(tag, version)] = self.var.codec(version, ttl=tag == TAG_EXPIRING)
        return c

    def _alive(self, stored: bytes | None) -> bool:
        return stored is not None and not expired(stored, self.states.now_ms) and not self._dropped(stored)

    def _dropped(self, stored: bytes) -> bool:
        """Whether ``stored`` is a typed value of a version below this declaration's first: left by a
        variable of the same name whose drop has not run yet, never read as this one's type."""
        return (self._first > 1 and len(stored) > 2 and stored[0] in (TAG_TYPED, TAG_EXPIRING)
                and stored[1] | stored[2] << 8 < self._first)

    def _decode(self, stored: bytes) -> Any:
        """One stored value (alive) as a Python value of the current declaration."""
        tag = stored[0]
        if tag == TAG_TYPED or tag == TAG_EXPIRING:
            version = stored[1] | stored[2] << 8
            if version < self._first:
                return None
            codec = self._codec_of(tag, version)
            value, _ = codec.decode_py(stored)
            return value if version == self.var.version else project_py(value, codec.dtype, self.var.spec.type)
        return self._legacy(decode_value(stored))

    def _legacy(self, value: Any) -> Any:
        try:
            return pa.array([value], type=self.var.spec.type)[0].as_py()
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as exc:
            raise StateEncodingError(f"state variable {self.name!r} holds an untyped value {str(value)[:60]!r} "
                                     f"written before it was declared, which is not a {self.var.spec.type}: {exc}. "
                                     f"Declare a type that fits, or delete_states=[{self.name!r}]") from None

    def _decode_column(self, stored: list[bytes]) -> pa.Array:
        """Many stored values (alive) as one Arrow array of the current type, in order."""
        n = len(stored)
        if n == 0:
            return pa.array([], type=self.var.spec.type)
        head = self.codec.tag, self.var.version
        first = stored[0][0], stored[0][1] | stored[0][2] << 8 if len(stored[0]) >= 3 else 0
        if first == head and all(s[0] == head[0] and (s[1] | s[2] << 8) == head[1] for s in stored):
            return self.codec.decode(stored)[0]
        groups: dict[tuple[int, int], list[int]] = {}
        for i, s in enumerate(stored):
            tag = s[0]
            key = (tag, s[1] | s[2] << 8) if tag in (TAG_TYPED, TAG_EXPIRING) else (tag, 0)
            groups.setdefault(key, []).append(i)
        pieces: list[pa.Array] = []
        order: list[int] = []
        for (tag, version), idx in groups.items():
            rows = [stored[i] for i in idx]
            if version == 0:
                arr = pa.array([self._legacy(decode_value(r)) for r in rows], type=self.var.spec.type)
            elif version < self._first:   # a dropped variable's (the views leave them out before): null
                arr = pa.nulls(len(rows), type=self.var.spec.type)
            else:
                codec = self._codec_of(tag, version)
                arr = codec.decode(rows)[0]
                if version != self.var.version:
                    arr = codec.project(arr, self.codec)
                elif arr.type != self.var.spec.type:
                    arr = arr.cast(self.var.spec.type)
            pieces.append(arr)
            order += idx
        merged = pa.concat_arrays(pieces)
        return merged.take(pa.array(np.argsort(np.asarray(order), kind="stable")))

    def _touch(self, db: Any, k: bytes, stored: bytes) -> None:
        """On read and write: move a read entry's expiry to now + ttl."""
        exp = self._expiry
        assert exp is not None
        if stored[0] == TAG_EXPIRING:
            self._put(db, k, with_expiry(stored, exp), exp)
        else:   # written before the TTL was declared: rewrite it with one
            self._put(db, k, self.codec.encode_py(self._decode(stored), exp), exp)

    def _encode_many(self, values: Any) -> list[bytes]:
        arr = _as_arrow(values, self.var.spec.type, self.name)
        exp = self._expiry
        return self.codec.encode(arr, expiry=exp)

    def _read_many(self, entry_keys: list[bytes]) -> pa.Array:
        """The values at ``entry_keys`` (one multi-get), null where absent or expired; with
        ``on_read_and_write`` the alive ones' expiry moves."""
        if not entry_keys:
            return pa.array([], type=self.var.spec.type)
        order = _key_order(self, entry_keys)
        if order is None:
            stored = cast("list[bytes | None]", self.backend.store.get(cast("list[Any]", entry_keys)))
        else:   # read in key order, then put back in the keys' order
            found = np.empty(len(entry_keys), dtype=object)
            found[order] = self.backend.store.get([entry_keys[i] for i in order.tolist()])
            stored = found.tolist()
        now = self.states.now_ms
        if not self.on_read:
            fast = self._read_uniform(stored, now)
            if fast is not None:
                return fast
        alive = [i for i, v in enumerate(stored) if self._alive(v)]
        if self.on_read and alive:
            wb = self.backend.new_batch()
            for i in alive:
                self._touch(wb, entry_keys[i], cast(bytes, stored[i]))
            self.backend.store.write(wb)
        values = self._decode_column([cast(bytes, stored[i]) for i in alive])
        if len(alive) == len(entry_keys):
            return values
        positions = np.full(len(entry_keys), -1, dtype=np.int64)
        positions[np.asarray(alive, dtype=np.int64)] = np.arange(len(alive))
        return values.take(pa.array(positions, mask=positions < 0))

    def _read_uniform(self, stored: list[bytes | None], now: int) -> pa.Array | None:
        """:meth:`_read_many`'s values when every stored one is of the current fixed-width encoding
        (the common case), found and checked by numpy over all of them at once; None otherwise."""
        codec = self.codec
        if not codec.fixed_width:
            return None
        n = len(stored)
        objects = np.empty(n, dtype=object)
        objects[:] = stored
        present = np.flatnonzero(objects != None)  # noqa: E711 - elementwise, not identity
        rows = stored if len(present) == n else objects[present].tolist()
        width = codec.record_width
        joined = b"".join(cast("list[bytes]", rows))
        if len(joined) != len(rows) * width:
            return None
        head = np.frombuffer(joined, dtype=np.uint8).reshape(-1, width)
        if len(rows) and not (np.all(head[:, 0] == codec.tag)
                              and np.all(head[:, 1].astype(np.uint16) | head[:, 2].astype(np.uint16) << 8
                                         == self.var.version)):
            return None
        values, expiries = codec.decode_joined(joined, len(rows))
        if values.type != self.var.spec.type:
            return None
        alive = np.ones(len(rows), dtype=bool) if expiries is None else expiries > now
        if len(present) == n and alive.all():
            return values
        positions = np.full(n, -1, dtype=np.int64)
        positions[present[alive]] = np.flatnonzero(alive)
        return values.take(pa.array(positions, mask=positions < 0))

    def _write_many(self, entry_keys: list[bytes], arr: pa.Array) -> None:
        """Put ``arr[i]`` at ``entry_keys[i]`` in one write batch, built in key order (of equal keys the
        last one wins, as in the keys' order); a null deletes the entry."""
        valid = np.asarray(arr.is_valid()) if arr.null_count else None
        encoded = self._encode_many(arr.filter(pa.array(valid)) if valid is not None else arr)
        exp = self._expiry
        order = _key_order(self, entry_keys)
        wb = self.backend.new_batch()
        if valid is None and exp is None:   # the common case: puts only
            if order is not None and self.backend.wants_sst(len(entry_keys) * (len(entry_keys[0]) + len(encoded[0]))):
                keep = _last_of_equal(self, entry_keys, order)   # an SST's keys are strictly increasing
                self.backend.ingest_sorted([entry_keys[i] for i in keep], [encoded[i] for i in keep])
                return
            put = wb.put
            if order is None:
                for k, stored in zip(entry_keys, encoded):
                    put(k, stored)
            else:
                for i in order.tolist():
                    put(entry_keys[i], encoded[i])
            self.backend.store.write(wb)
            return
        values: list[bytes | None] = list(encoded)
        if valid is not None:
            values = [None] * len(entry_keys)
            for i, stored in zip(np.flatnonzero(valid).tolist(), encoded):
                values[i] = stored
        for i in order.tolist() if order is not None else range(len(entry_keys)):
            v = values[i]
            if v is None:
                wb.delete(entry_keys[i])
            else:
                self._put(wb, entry_keys[i], v, exp)
        self.backend.store.write(wb)

    def _clear_ranges(self, prefixes: list[bytes]) -> None:
        wb = self.backend.new_batch()
        for k in prefixes:
            wb.delete_range(k, _prefix_upper(k))
        self.backend.store.write(wb)


class TypedValue(_Typed):
    """A declared value per key."""

    kind = KIND_VALUE

    def get(self, key: object) -> Any:
        k = self._prefix(key)
        stored = self.backend.store.get(k)
        if not self._alive(stored):
            return None
        assert stored is not None
        if self.on_read:
            self._touch(self.backend.store, k, stored)
        return self._decode(stored)

    def update(self, key: object, value: Any) -> None:
        """Set the value; ``None`` clears it."""
        k = self._prefix(key)
        if value is None:
            self.backend.store.delete(k)
            return
        exp = self._expiry
        self._put(self.backend.store, k, self.codec.encode_py(value, exp), exp)

    def clear(self, key: object) -> None:
        self.backend.store.delete(self._prefix(key))

    # --- vectorized -------------------------------------------------------------------------------
    def get_many(self, keys: Any) -> pa.Array:
        """The values of ``keys`` as an Arrow array of the declared type (null where absent or expired)."""
        return self._read_many(_raw_keys(self, keys))

    def put_many(self, keys: Any, values: Any) -> None:
        """Set the values of ``keys`` in one write batch; a null value clears its key."""
        raw = _raw_keys(self, keys)
        arr = _as_arrow(values, self.var.spec.type, self.name)
        if len(arr) != len(raw):
            raise StateEncodingError(f"state {self.name!r}: put_many got {len(raw)} keys but {len(arr)} values")
        self._write_many(raw, arr)

    def clear_many(self, keys: Any) -> None:
        wb = self.backend.new_batch()
        for k in _raw_keys(self, keys):
            wb.delete(k)
        self.backend.store.write(wb)

    def bind(self, key: object) -> BoundValue:
        return BoundValue(self, key)


class TypedList(_Typed):
    """A declared list per key: each element its own entry, with its own expiry."""

    kind = KIND_LIST

    def _scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        return self.backend._scan(prefix, _prefix_upper(prefix), len(prefix))

    def _alive_entries(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """The alive ``(suffix, stored)`` of one list (a whole old JSON list under suffix ``b""``)."""
        return [(s, v) for s, v in self._scan(prefix) if self._alive(v)]

    def get(self, key: object) -> list[Any]:
        prefix = self._prefix(key)
        out: list[Any] = []
        if not self.on_read:   # numbers of the current version: decoded and checked for expiry in one pass
            found = list(self._scan(prefix))
            if found and all(s for s, _ in found):
                fast = self.codec.decode_many_py([v for _, v in found], self.states.now_ms)
                if fast is not None:
                    return fast
            entries = [(s, v) for s, v in found if self._alive(v)]
        else:
            entries = self._alive_entries(prefix)
        fast = self.codec.decode_many_py([v for s, v in entries]) if all(s for s, _ in entries) else None
        if fast is not None:   # every element a typed number of the current version
            out = fast
        else:
            for suffix, stored in entries:
                if not suffix:   # an untyped list, stored whole before the variable was declared
                    out.extend(self._legacy_list(stored))
                else:
                    out.append(self._decode(stored))
        if self.on_read and entries:
            wb = self.backend.new_batch()
            for suffix, stored in entries:
                if suffix:
                    self._touch(wb, prefix + suffix, stored)
            self.backend.store.write(wb)
        return out

    def _legacy_list(self, stored: bytes) -> list[Any]:
        value = decode_value(stored)
        return [self._legacy(v) for v in (value if isinstance(value, list) else [value])]

    def append(self, key: object, value: Any) -> None:
        if value is None:
            raise StateEncodingError(f"list state {self.name!r}: None cannot be appended")
        exp = self._expiry
        k = self._prefix(key) + self.states.next_seq().to_bytes(8, "big")
        self._put(self.backend.store, k, self.codec.encode_py(value, exp), exp)

    def extend(self, key: object, values: Iterable[Any]) -> None:
        values = list(values)
        if len(values) <= 8:   # a few values: one at a time is cheaper than the Arrow column path
            for v in values:
                self.append(key, v)
            return
        self.append_many([key] * len(values), values)

    def update(self, key: object, values: Iterable[Any]) -> None:
        """Replace the list with ``values``."""
        self.clear(key)
        self.extend(key, values)

    def clear(self, key: object) -> None:
        prefix = self._prefix(key)
        self.backend.store.delete_range(prefix, _prefix_upper(prefix))

    # --- vectorized -------------------------------------------------------------------------------
    def get_many(self, keys: Any) -> pa.Array:
        """The lists of ``keys`` as an Arrow list array (an empty list where there is none)."""
        prefixes = _raw_keys(self, keys)
        offsets = [0]
        stored: list[bytes] = []
        legacy: dict[int, list[Any]] = {}
        touched: list[tuple[bytes, bytes]] = []
        for prefix in prefixes:
            for suffix, v in self._alive_entries(prefix):
                if not suffix:
                    legacy[len(stored)] = self._legacy_list(v)
                    stored.append(b"")
                else:
                    stored.append(v)
                    if self.on_read:
                        touched.append((prefix + suffix, v))
            offsets.append(len(stored))
        if touched:
            wb = self.backend.new_batch()
            for k, v in touched:
                self._touch(wb, k, v)
            self.backend.store.write(wb)
        if legacy:   # rare: expand the old whole lists in place
            return pa.array([self.get(k) for k in _as_pylist(keys)], type=pa.list_(self.var.spec.type))
        values = self._decode_column(stored)
        return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values)

    def append_many(self, keys: Any, values: Any) -> None:
        """Append ``values[i]`` to the list of ``keys[i]`` (a key may repeat), in one write batch."""
        raw = _raw_keys(self, keys)
        arr = _as_arrow(values, self.var.spec.type, self.name)
        if len(arr) != len(raw):
            raise StateEncodingError(f"list state {self.name!r}: append_many got {len(raw)} keys but {len(arr)} "
                                     f"values")
        if not raw:
            return
        encoded = self._encode_many(arr)
        exp = self._expiry
        first = self.states.next_seq(len(raw))
        wb = self.backend.new_batch()
        for j, (k, stored) in enumerate(zip(raw, encoded)):
            self._put(wb, k + (first + j).to_bytes(8, "big"), stored, exp)
        self.backend.store.write(wb)

    def clear_many(self, keys: Any) -> None:
        """Remove the whole list (map) of each of ``keys``, in one write batch."""
        self._clear_ranges(_raw_keys(self, keys))

    def bind(self, key: object) -> BoundList:
        return BoundList(self, key)


class TypedMap(_Typed):
    """A declared map per key: each entry its own RocksDB entry, with its own expiry."""

    kind = KIND_MAP

    def __init__(self, states: TypedStates, var: VariableRecord) -> None:
        super().__init__(states, var)
        assert var.spec.key_type is not None
        self.key_codec = RowCodec(self.name, var.spec.key_type)

    def _entry(self, key: object, map_key: Any) -> bytes:
        if map_key is None:
            raise StateEncodingError(f"map state {self.name!r}: a map key cannot be None")
        return self._prefix(key) + self.key_codec.encode_py(map_key)

    def _map_key(self, suffix: bytes) -> Any:
        if suffix[:1] == bytes((TAG_TYPED,)):
            return self.key_codec.decode_py(suffix)[0]
        return decode_value(suffix)   # a map key an untyped view wrote

    def get(self, key: object, map_key: Any) -> Any:
        k = self._entry(key, map_key)
        stored = self.backend.store.get(k)
        if not self._alive(stored):
            return None
        assert stored is not None
        if self.on_read:
            self._touch(self.backend.store, k, stored)
        return self._decode(stored)

    def contains(self, key: object, map_key: Any) -> bool:
        return self._alive(self.backend.store.get(self._entry(key, map_key)))

    def put(self, key: object, map_key: Any, value: Any) -> None:
        if value is None:
            self.remove(key, map_key)
            return
        exp = self._expiry
        self._put(self.backend.store, self._entry(key, map_key), self.codec.encode_py(value, exp), exp)

    def put_all(self, key: object, entries: Mapping[Any, Any]) -> None:
        exp = self._expiry
        prefix = self._prefix(key)
        wb = self.backend.new_batch()
        for mk, v in entries.items():
            if mk is None:
                raise StateEncodingError(f"map state {self.name!r}: a map key cannot be None")
            k = prefix + self.key_codec.encode_py(mk)
            if v is None:
                wb.delete(k)
            else:
                self._put(wb, k, self.codec.encode_py(v, exp), exp)
        self.backend.store.write(wb)

    def remove(self, key: object, map_key: Any) -> None:
        self.backend.store.delete(self._entry(key, map_key))

    def _entries(self, key: object) -> list[tuple[bytes, bytes]]:
        prefix = self._prefix(key)
        found = [(s, v) for s, v in self.backend._scan(prefix, _prefix_upper(prefix), len(prefix))
                 if self._alive(v)]
        if self.on_read and found:
            wb = self.backend.new_batch()
            for s, v in found:
                self._touch(wb, prefix + s, v)
            self.backend.store.write(wb)
        return found

    def items(self, key: object) -> list[tuple[Any, Any]]:
        return [(self._map_key(s), self._decode(v)) for s, v in self._entries(key)]

    def keys(self, key: object) -> list[Any]:
        return [self._map_key(s) for s, _ in self._entries(key)]

    def values(self, key: object) -> list[Any]:
        return [self._decode(v) for _, v in self._entries(key)]

    def clear(self, key: object) -> None:
        prefix = self._prefix(key)
        self.backend.store.delete_range(prefix, _prefix_upper(prefix))

    # --- vectorized -------------------------------------------------------------------------------
    def get_many(self, keys: Any, map_keys: Any) -> pa.Array:
        """``map[keys[i]][map_keys[i]]`` for every i, null where absent or expired."""
        raw = _raw_keys(self, keys)
        mks = _as_arrow(map_keys, self.key_codec.dtype, f"{self.name} (map keys)")
        if len(mks) != len(raw):
            raise StateEncodingError(f"map state {self.name!r}: get_many got {len(raw)} keys but {len(mks)} map keys")
        return self._read_many([k + mk for k, mk in zip(raw, self.key_codec.encode(mks))])

    def put_many(self, keys: Any, map_keys: Any, values: Any) -> None:
        """Set ``map[keys[i]][map_keys[i]] = values[i]`` in one write batch; a null value removes the entry."""
        raw = _raw_keys(self, keys)
        mks = _as_arrow(map_keys, self.key_codec.dtype, f"{self.name} (map keys)")
        arr = _as_arrow(values, self.var.spec.type, self.name)
        if not len(raw) == len(mks) == len(arr):
            raise StateEncodingError(f"map state {self.name!r}: put_many got {len(raw)} keys, {len(mks)} map keys and "
                                     f"{len(arr)} values")
        if mks.null_count:
            raise StateEncodingError(f"map state {self.name!r}: a map key cannot be null")
        self._write_many([k + mk for k, mk in zip(raw, self.key_codec.encode(mks))], arr)

    def items_many(self, keys: Any) -> pa.Array:
        """The maps of ``keys`` as an Arrow map array (an empty map where there is none)."""
        offsets = [0]
        mk_rows: list[Any] = []
        stored: list[bytes] = []
        for k in _as_pylist(keys):
            for s, v in self._entries(k):
                mk_rows.append(self._map_key(s))
                stored.append(v)
            offsets.append(len(stored))
        values = self._decode_column(stored)
        return pa.MapArray.from_arrays(pa.array(offsets, pa.int32()),
                                       pa.array(mk_rows, type=self.key_codec.dtype), values)

    def clear_many(self, keys: Any) -> None:
        """Remove the whole list (map) of each of ``keys``, in one write batch."""
        self._clear_ranges(_raw_keys(self, keys))

    def bind(self, key: object) -> BoundMap:
        return BoundMap(self, key)


# --- bound to one key (the per-key form) -------------------------------------------------------------
class _Bound:
    __slots__ = ("_key", "_view")

    def __init__(self, view: Any, key: object) -> None:
        self._view = view
        self._key = key


class BoundValue(_Bound):
    """A declared value state fixed to the current key."""

    __slots__ = ()
    _view: TypedValue

    def get(self) -> Any:
        return self._view.get(self._key)

    def exists(self) -> bool:
        return self._view.get(self._key) is not None

    def update(self, value: Any) -> None:
        self._view.update(self._key, value)

    def clear(self) -> None:
        self._view.clear(self._key)


class BoundList(_Bound):
    """A declared list state fixed to the current key."""

    __slots__ = ()
    _view: TypedList

    def get(self) -> list[Any]:
        return self._view.get(self._key)

    def append(self, value: Any) -> None:
        self._view.append(self._key, value)

    def extend(self, values: Iterable[Any]) -> None:
        self._view.extend(self._key, values)

    def update(self, values: Iterable[Any]) -> None:
        self._view.update(self._key, values)

    def clear(self) -> None:
        self._view.clear(self._key)


class BoundMap(_Bound):
    """A declared map state fixed to the current key."""

    __slots__ = ()
    _view: TypedMap

    def get(self, map_key: Any) -> Any:
        return self._view.get(self._key, map_key)

    def put(self, map_key: Any, value: Any) -> None:
        self._view.put(self._key, map_key, value)

    def put_all(self, entries: Mapping[Any, Any]) -> None:
        self._view.put_all(self._key, entries)

    def remove(self, map_key: Any) -> None:
        self._view.remove(self._key, map_key)

    def contains(self, map_key: Any) -> bool:
        return self._view.contains(self._key, map_key)

    def items(self) -> list[tuple[Any, Any]]:
        return self._view.items(self._key)

    def keys(self) -> list[Any]:
        return self._view.keys(self._key)

    def values(self) -> list[Any]:
        return self._view.values(self._key)

    def clear(self) -> None:
        self._view.clear(self._key)


# --- physical removal -------------------------------------------------------------------------------
@dataclass(frozen=True)
class SweepStats:
    """What one :func:`sweep_expired` did."""

    deleted: int        # expired entries removed
    stale: int          # index keys whose entry had been written again (or removed) since
    more: bool          # the budget ran out before everything expired was swept
    ms: float


def sweep_expired(backend: StateDB, now_ms: int, *, start: int = 0, max_entries: int = 100_000,
                  max_ms: float = 200.0) -> SweepStats:
    """Remove what expired at or before ``now_ms`` in the backend's key groups, through the expiry
    index, within ``max_entries`` index keys and about ``max_ms``. Key groups are visited from the
    ``start``-th on (rotate it per batch so that a spent budget does not always favour the first)."""
    began = time.perf_counter()
    db = backend.db
    groups = list(range(backend.key_groups.start, backend.key_groups.stop))
    if groups:
        at = start % len(groups)
        groups = groups[at:] + groups[:at]
    deleted = stale = seen = 0
    more = False
    wb = rocksdict.WriteBatch(raw_mode=True)
    bound = (now_ms + 1).to_bytes(_EXPIRY_LEN, "big") if now_ms >= 0 else b""
    for g in groups:
        gb = g.to_bytes(2, "big")
        lower = gb + KIND_EXPIRY
        if not bound:
            break
        ro = rocksdict.ReadOptions()
        ro.set_iterate_upper_bound(lower + bound)
        it = db.iter(ro)
        try:
            it.seek(lower)
            while it.valid():
                if seen >= max_entries or (seen % 256 == 0 and (time.perf_counter() - began) * 1000 > max_ms):
                    more = True
                    break
                ik = it.key()
                entry = gb + ik[3 + _EXPIRY_LEN:]
                stored = db.get(entry)
                if stored is not None and expired(stored, now_ms) and expiry_of(stored) == int.from_bytes(
                        ik[3:3 + _EXPIRY_LEN], "big"):
                    wb.delete(entry)
                    deleted += 1
                else:
                    stale += 1
                wb.delete(ik)
                seen += 1
                it.next()
        finally:
            del it
        if more:
            break
    if not wb.is_empty():
        db.write(wb)
    return SweepStats(deleted, stale, more, (time.perf_counter() - began) * 1000)


def drop_variables(backend: StateDB, names: Iterable[str]) -> int:
    """Delete every entry of the variables ``names`` (``delete_states``) in the backend's key groups,
    with their expiry-index keys; returns the range deletions written plus the index keys deleted.

    The index is ordered by expiry, not by variable, so finding a variable's index keys reads the
    whole index of each key group once (one pass for all ``names``); a drop runs once per variable.
    Running it again deletes nothing more."""
    middles = tuple(state_middle(kind, name) for name in names for kind in (KIND_VALUE, KIND_LIST, KIND_MAP))
    if not middles:
        return 0
    wb = rocksdict.WriteBatch(raw_mode=True)
    n = 0
    db = backend.db
    start = 3 + _EXPIRY_LEN   # an index key: group, 'x', expiry, then the entry's key from its kind on
    for g in range(backend.key_groups.start, backend.key_groups.stop):
        gb = g.to_bytes(2, "big")
        for middle in middles:
            wb.delete_range(gb + middle, _prefix_upper(gb + middle))
            n += 1
        lower = gb + KIND_EXPIRY
        ro = rocksdict.ReadOptions()
        ro.set_iterate_upper_bound(_prefix_upper(lower))
        it = db.iter(ro)
        try:
            it.seek(lower)
            while it.valid():
                ik = it.key()
                if ik.startswith(middles, start):
                    wb.delete(ik)
                    n += 1
                it.next()
        finally:
            del it
    db.write(wb)
    return n


# --- helpers -----------------------------------------------------------------------------------------
def _raw_keys(view: _Typed, keys: Any) -> list[bytes]:
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
    return raw_keys(view.backend, view._middle, _as_pylist(keys))


def _key_order(view: _Typed, raw: list[bytes]) -> np.ndarray | None:
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


def _raw_array(view: _Typed, raw: list[bytes]) -> pa.Array:
    """``raw`` as an Arrow binary array: the one :func:`_string_raw_keys` built them from, if it did."""
    built = view._last_raw
    return built[1] if built is not None and built[0] is raw else pa.array(raw, pa.binary())


def _last_of_equal(view: _Typed, raw: list[bytes], order: np.ndarray) -> list[int]:
    """The positions of :func:`_key_order`'s ``order`` without all but the last of equal keys (the
    sort is stable, so equal keys sit together in the callers' order)."""
    in_order = _raw_array(view, raw).take(pa.array(order))
    if len(in_order) < 2:
        return cast("list[int]", order.tolist())
    repeated = np.asarray(pc.equal(in_order.slice(0, len(in_order) - 1), in_order.slice(1)))
    return cast("list[int]", order[np.append(~repeated, True)].tolist())


def _string_raw_keys(view: _Typed, keys: pa.Array) -> list[bytes] | None:
    """:func:`~sparksteward.state.views.raw_keys` of an Arrow string array of a string-keyed state,
    with the key groups computed by numpy over the hashes and the keys joined by numpy into one buffer
    (None for any other key or array type). Leaves the keys as an Arrow array in ``view._last_raw``
    for :func:`_key_order`."""
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
        b._key(keys[int(outside[0])].as_py())   # raises the error naming the key
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


def _as_pylist(values: Any) -> list[Any]:
    to_pylist = getattr(values, "to_pylist", None)
    if to_pylist is not None:
        return cast("list[Any]", to_pylist())
    tolist = getattr(values, "tolist", None)
    if tolist is not None:
        return cast("list[Any]", tolist())
    return list(values)


def _as_arrow(values: Any, dtype: pa.DataType, name: str) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if isinstance(values, pa.Array):
        if values.type == dtype:
            return values
        try:
            return values.cast(dtype)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise StateEncodingError(f"state {name!r} is declared {dtype}, but the values have type {values.type}, "
                                     f"which does not cast: {exc}") from None
    try:
        return pa.array(_as_pylist(values) if not isinstance(values, list) else values, type=dtype)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as exc:
        raise StateEncodingError(f"values for state {name!r} do not fit its declared type {dtype}: {exc}") from None
