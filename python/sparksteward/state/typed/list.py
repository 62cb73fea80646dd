"""Declared list states (decision 0017): a list per key, each element its own RocksDB entry with its
own expiry, read and written over many keys at once (:class:`TypedList`, Arrow in and out) or fixed to
one key (:class:`BoundList`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa

from sparksteward.errors import StateEncodingError
from sparksteward.state.encoding import KIND_LIST, decode_value
from sparksteward.state.typed.arrow_keys import keys_of
from sparksteward.state.typed.base import BoundView, TypedView
from sparksteward.state.typed.columns import as_arrow, as_pylist
from sparksteward.state.views import _prefix_upper

__all__ = ["BoundList", "TypedList"]


class TypedList(TypedView):
    """A declared list per key: each element its own entry, with its own expiry."""

    kind = KIND_LIST

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        #: the last sequence this view appended under each list prefix
        self._tails: dict[bytes, int] = {}

    def _seq(self, prefix: bytes, candidate: int) -> int:
        """The sequence of an element appended to the list at ``prefix``: ``candidate`` (this batch's
        next), or one past the list's last element where that is later. A state restored from a
        savepoint of a state that ran more batches, or a bootstrapped one, holds elements of sequences
        above this batch's: an append must never replace one of them or come before it."""
        tail = self._tails.get(prefix)
        if tail is None:
            tail = self._stored_tail(prefix)
        seq = candidate if candidate > tail else tail + 1
        self._tails[prefix] = seq
        return seq

    def _stored_tail(self, prefix: bytes) -> int:
        """The sequence of the last element the DB holds under ``prefix`` (-1: none)."""
        upper = _prefix_upper(prefix)
        it = self.backend.db.iter()
        try:
            it.seek_for_prev(upper)
            if it.valid() and it.key() >= upper:
                it.prev()
            if it.valid():
                k = it.key()
                if len(k) == len(prefix) + 8 and k.startswith(prefix):
                    return int.from_bytes(k[-8:], "big")
            return -1
        finally:
            del it

    def _scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        return self.backend.scan(prefix, _prefix_upper(prefix), len(prefix))

    def _alive_entries(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """The alive ``(suffix, stored)`` of one list (a whole old JSON list under suffix ``b""``)."""
        return [(s, v) for s, v in self._scan(prefix) if self._alive(v)]

    def get(self, key: object) -> list[Any]:
        prefix = self._prefix(key)
        out: list[Any] = []
        if not self.on_read:   # numbers of the current version: decoded and checked for expiry in one pass
            found = list(self._scan(prefix))
            if found and all(s for s, _ in found):
                fast = self.codec.decode_many_py([v for _, v in found], self._now)
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
        prefix = self._prefix(key)
        k = prefix + self._seq(prefix, self.states.next_seq()).to_bytes(8, "big")
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
        prefixes = keys_of(self, keys)
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
            return pa.array([self.get(k) for k in as_pylist(keys)], type=pa.list_(self.var.spec.type))
        values = self._decode_column(stored)
        return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values)

    def append_many(self, keys: Any, values: Any) -> None:
        """Append ``values[i]`` to the list of ``keys[i]`` (a key may repeat), in one write batch."""
        raw = keys_of(self, keys)
        arr = as_arrow(values, self.var.spec.type, self.name)
        if len(arr) != len(raw):
            raise StateEncodingError(f"list state {self.name!r}: append_many got {len(raw)} keys but {len(arr)} "
                                     f"values")
        if not raw:
            return
        encoded = self._encode_many(arr)
        exp = self._expiry
        first = self.states.next_seq(len(raw))
        wb = self.backend.new_batch()
        tails = self._tails
        for k in set(raw).difference(tails):
            tails[k] = self._stored_tail(k)
        for j, (k, stored) in enumerate(zip(raw, encoded)):
            tail = tails[k]
            seq = tails[k] = first + j if first + j > tail else tail + 1
            self._put(wb, k + seq.to_bytes(8, "big"), stored, exp)
        self.backend.store.write(wb)

    def clear_many(self, keys: Any) -> None:
        """Remove the whole list (map) of each of ``keys``, in one write batch."""
        self._clear_ranges(keys_of(self, keys))

    def bind(self, key: object) -> BoundList:
        return BoundList(self, key)


class BoundList(BoundView):
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
