"""Declared map states (decision 0017): a map per key, each entry its own RocksDB entry with its own
expiry, keyed by the declared key type, read and written over many keys at once (:class:`TypedMap`,
Arrow in and out) or fixed to one key (:class:`BoundMap`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from sparksteward.errors import StateEncodingError
from sparksteward.state.declared import VariableRecord
from sparksteward.state.encoding import KIND_MAP, decode_value
from sparksteward.state.rows import TAG_TYPED, RowCodec
from sparksteward.state.typed.arrow_keys import keys_of
from sparksteward.state.typed.base import BoundView, Holder, TypedView
from sparksteward.state.typed.columns import as_arrow, as_pylist
from sparksteward.state.views import _prefix_upper

__all__ = ["BoundMap", "TypedMap"]


class TypedMap(TypedView):
    """A declared map per key: each entry its own RocksDB entry, with its own expiry."""

    kind = KIND_MAP

    def __init__(self, states: Holder, var: VariableRecord) -> None:
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
        return self._read(self._entry(key, map_key))

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
        found = [(s, v) for s, v in self.backend.scan(prefix, _prefix_upper(prefix), len(prefix))
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
        raw = keys_of(self, keys)
        mks = as_arrow(map_keys, self.key_codec.dtype, f"{self.name} (map keys)")
        if len(mks) != len(raw):
            raise StateEncodingError(f"map state {self.name!r}: get_many got {len(raw)} keys but {len(mks)} map keys")
        return self._read_many([k + mk for k, mk in zip(raw, self.key_codec.encode(mks))])

    def put_many(self, keys: Any, map_keys: Any, values: Any) -> None:
        """Set ``map[keys[i]][map_keys[i]] = values[i]`` in one write batch; a null value removes the entry."""
        raw = keys_of(self, keys)
        mks = as_arrow(map_keys, self.key_codec.dtype, f"{self.name} (map keys)")
        arr = as_arrow(values, self.var.spec.type, self.name)
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
        for k in as_pylist(keys):
            for s, v in self._entries(k):
                mk_rows.append(self._map_key(s))
                stored.append(v)
            offsets.append(len(stored))
        values = self._decode_column(stored)
        return pa.MapArray.from_arrays(pa.array(offsets, pa.int32()),
                                       pa.array(mk_rows, type=self.key_codec.dtype), values)

    def clear_many(self, keys: Any) -> None:
        """Remove the whole list (map) of each of ``keys``, in one write batch."""
        self._clear_ranges(keys_of(self, keys))

    def bind(self, key: object) -> BoundMap:
        return BoundMap(self, key)


class BoundMap(BoundView):
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
