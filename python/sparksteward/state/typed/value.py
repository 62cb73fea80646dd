"""Declared value states (decision 0017): one value per key, read and written over many keys at once
(:class:`TypedValue`, Arrow in and out) or fixed to one key (:class:`BoundValue`)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from sparksteward.errors import StateEncodingError
from sparksteward.state.encoding import KIND_VALUE
from sparksteward.state.typed.arrow_keys import keys_of
from sparksteward.state.typed.base import BoundView, TypedView
from sparksteward.state.typed.columns import as_arrow

__all__ = ["BoundValue", "TypedValue"]


class TypedValue(TypedView):
    """A declared value per key."""

    kind = KIND_VALUE

    def get(self, key: object) -> Any:
        return self._read(self._prefix(key))

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
        return self._read_many(keys_of(self, keys))

    def put_many(self, keys: Any, values: Any) -> None:
        """Set the values of ``keys`` in one write batch; a null value clears its key."""
        raw = keys_of(self, keys)
        arr = as_arrow(values, self.var.spec.type, self.name)
        if len(arr) != len(raw):
            raise StateEncodingError(f"state {self.name!r}: put_many got {len(raw)} keys but {len(arr)} values")
        self._write_many(raw, arr)

    def clear_many(self, keys: Any) -> None:
        wb = self.backend.new_batch()
        for k in keys_of(self, keys):
            wb.delete(k)
        self.backend.store.write(wb)

    def bind(self, key: object) -> BoundValue:
        return BoundValue(self, key)


class BoundValue(BoundView):
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
