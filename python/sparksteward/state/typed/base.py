"""The shared base of the typed views of declared state variables (decision 0017): keys, writes with
their expiry, and the decoding of stored values, one at a time or as a column. The kinds build on it
(:mod:`~sparksteward.state.typed.value`, :mod:`~sparksteward.state.typed.list`,
:mod:`~sparksteward.state.typed.map`), each in a vectorized form (over many keys at once, Arrow in and
out) and bound to one key (the per-key form, :class:`BoundView`).

**Layout.** A value is one RocksDB entry at the key of :mod:`sparksteward.state.encoding` (kind ``v``).
A list element is its own entry: the list's key plus an 8-byte big-endian sequence,
``(batch << 32) | n`` with ``n`` counting this subtask's appends in the batch, so appends need no read
and a scan returns the elements in order. A map entry is its own entry: the map's key plus the map
key, encoded as a typed value of the declared key type. So an append, a put and a get of one entry
cost the same whatever the size of the list or map.

**TTL.** A value, element or entry of a variable with a TTL carries its expiry in its header
(:data:`~sparksteward.state.rows.TAG_EXPIRING`) and an expiry-index key
(:mod:`~sparksteward.state.typed.ttl`); a read never returns an expired one.

**Dropped values.** A typed value of a version below the variable's first
(:class:`~sparksteward.state.declared.VariableRecord`) belongs to a dropped variable of the same name
whose drop has not run yet: every read leaves it out.

**Old values.** JSON values an untyped view wrote under the same name (the named states before
declarations) are read and converted to the declared type; a JSON list stored whole is read as the
list's first elements.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import numpy as np
import pyarrow as pa

from sparksteward.errors import StateEncodingError
from sparksteward.state.declared import VariableRecord
from sparksteward.state.encoding import decode_value, key_prefix
from sparksteward.state.rows import TAG_EXPIRING, TAG_TYPED, RowCodec, expired, project_py, with_expiry
from sparksteward.state.typed.arrow_keys import get_stored, key_order, last_of_equal
from sparksteward.state.typed.columns import as_arrow
from sparksteward.state.typed.ttl import KIND_EXPIRY, KIND_EXPIRY_EVENT, index_key
from sparksteward.state.views import StateDB, _prefix_upper, state_middle

__all__ = ["BoundView", "Holder", "TypedView"]

_NO_WATERMARK = -(1 << 62)   # event-time TTL before the first watermark: every expiry lies after it


class Holder(Protocol):
    """What a view needs of the holder of its variables (:class:`~sparksteward.state.typed.states.TypedStates`):
    the backend, the batch's processing time and watermark, and fresh list sequence numbers of the batch."""

    backend: StateDB
    now_ms: int
    watermark_ms: int | None
    batch: int

    def next_seq(self, n: int = 1) -> int: ...


class TypedView:
    """A declared variable's view over many keys: the base of :class:`~sparksteward.state.typed.value.TypedValue`,
    :class:`~sparksteward.state.typed.list.TypedList` and :class:`~sparksteward.state.typed.map.TypedMap`."""

    kind: bytes

    def __init__(self, states: Holder, var: VariableRecord) -> None:
        self.states = states
        self.var = var
        self.name = var.spec.name
        self.backend = states.backend
        self.ttl = var.spec.ttl_ms
        self.on_read = var.spec.ttl_update == "on_read_and_write" and self.ttl is not None
        self._event = var.spec.ttl_time == "event" and self.ttl is not None   # TTL by the watermark (0028)
        self._index = KIND_EXPIRY_EVENT if self._event else KIND_EXPIRY
        self._middle = state_middle(self.kind, self.name)
        self._last_keys: tuple[pa.Array, list[bytes]] | None = None
        self._last_order: tuple[list[bytes], np.ndarray] | None = None
        self._last_raw: tuple[list[bytes], pa.Array] | None = None   # arrow_keys' string keys as Arrow
        self._last_prefix: tuple[object, bytes] | None = None
        self.codec = var.codec()
        self._codecs: dict[tuple[int, int], RowCodec] = {(self.codec.tag, var.version): self.codec}
        self._first = var.first   # typed values of older versions are a dropped variable's (see _dropped)

    # --- keys and writes --------------------------------------------------------------------------
    def _prefix(self, key: object) -> bytes:
        last = self._last_prefix
        if last is not None and last[0] is key:   # the per-key form's bound key, again
            return last[1]
        group, raw = self.backend.owned_key(key)
        prefix = key_prefix(group, self.kind, self.name, raw)
        if type(key) is not bytearray:   # a key that cannot change under the same object
            self._last_prefix = (key, prefix)
        return prefix

    @property
    def _now(self) -> int:
        """The clock this variable expires by: the processing time, or (event-time TTL) the watermark;
        before there is one, a time before every expiry (nothing expires)."""
        if not self._event:
            return self.states.now_ms
        wm = self.states.watermark_ms
        return _NO_WATERMARK if wm is None else wm

    @property
    def _expiry(self) -> int | None:
        """The expiry of what is written now: the clock plus the TTL (event time before a watermark: the
        processing time's, so that an entry lives at least its TTL)."""
        if self.ttl is None:
            return None
        wm = self.states.watermark_ms
        return max(0, (wm if self._event and wm is not None else self.states.now_ms) + self.ttl)

    def _put(self, db: Any, k: bytes, stored: bytes, expiry: int | None) -> None:
        db.put(k, stored)
        if expiry is not None:
            db.put(index_key(k, expiry, self._index), b"")

    # --- decoding ---------------------------------------------------------------------------------
    def _codec_of(self, tag: int, version: int) -> RowCodec:
        c = self._codecs.get((tag, version))
        if c is None:
            c = self._codecs[(tag, version)] = self.var.codec(version, ttl=tag == TAG_EXPIRING)
        return c

    def _read(self, k: bytes) -> Any:
        """The value stored under raw key ``k``, or None when there is none alive (an on-read TTL renews it)."""
        stored = self.backend.store.get(k)
        if not self._alive(stored):
            return None
        assert stored is not None
        if self.on_read:
            self._touch(self.backend.store, k, stored)
        return self._decode(stored)

    def _alive(self, stored: bytes | None) -> bool:
        return stored is not None and not expired(stored, self._now) and not self._dropped(stored)

    def _dropped(self, stored: bytes) -> bool:
        """Whether ``stored`` is a typed value of a version below this declaration's first: left by a
        variable of the same name whose drop has not run yet, never read as this one's type."""
        return (self._first > 1 and len(stored) > 2 and stored[0] in (TAG_TYPED, TAG_EXPIRING)
                and stored[1] | stored[2] << 8 < self._first)

    def _decode(self, stored: bytes) -> Any:
        """One stored value (alive) as a Python value of the current declaration."""
        tag = stored[0]
        if tag in (TAG_TYPED, TAG_EXPIRING):
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
        if first == head:
            widths = set(map(len, stored))
            if self.codec.fixed_width and len(widths) == 1:   # one buffer, its headers checked as columns
                joined = b"".join(stored)
                heads = np.frombuffer(joined, dtype=np.uint8).reshape(n, widths.pop())
                if (heads[:, 0] == head[0]).all() and \
                        ((heads[:, 1].astype(np.uint16) | heads[:, 2].astype(np.uint16) << 8) == head[1]).all():
                    return self.codec.decode_joined(joined, n)[0]
            elif all(s[0] == head[0] and (s[1] | s[2] << 8) == head[1] for s in stored):
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
        arr = as_arrow(values, self.var.spec.type, self.name)
        exp = self._expiry
        return self.codec.encode(arr, expiry=exp)

    def _read_many(self, entry_keys: list[bytes]) -> pa.Array:
        """The values at ``entry_keys`` (one multi-get), null where absent or expired; with
        ``on_read_and_write`` the alive ones' expiry moves."""
        if not entry_keys:
            return pa.array([], type=self.var.spec.type)
        stored = get_stored(self, entry_keys)
        now = self._now
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
        order = key_order(self, entry_keys)
        wb = self.backend.new_batch()
        if valid is None and exp is None:   # the common case: puts only
            if order is not None and self.backend.wants_sst(len(entry_keys) * (len(entry_keys[0]) + len(encoded[0]))):
                keep = last_of_equal(self, entry_keys, order)   # an SST's keys are strictly increasing
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


class BoundView:
    """The base of a view fixed to one key (the per-key form)."""

    __slots__ = ("_key", "_view")

    def __init__(self, view: Any, key: object) -> None:
        self._view = view
        self._key = key

