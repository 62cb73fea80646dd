"""The per-key form's writes, buffered: one RocksDB write batch per subtask instead of one WAL record
per ``update``, with the current key's own writes readable (decision 0017).

A per-key function is called once per key per batch and reaches only its key's state, so the writes
of earlier keys are never read again in the batch: :class:`BufferedStore` keeps every write in one
``WriteBatch`` (written to the DB when it grows past ``flush_bytes`` between keys, and at the end) and
an overlay of the current key's writes and range deletions, which reads consult first.
:meth:`BufferedStore.next_key` starts a new key. RocksDB's WAL compresses a large batch as one record
(ZSTD), which a stream of single puts defeats.

:class:`Ops` is the write batch a view builds in buffered mode (``rocksdict.WriteBatch`` cannot be
read back): :meth:`BufferedStore.write` replays it into the buffer and the overlay.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import Any

import rocksdict

__all__ = ["BufferedStore", "Ops"]


class Ops:
    """Writes recorded for :meth:`BufferedStore.write` (the ``WriteBatch`` subset the views use)."""

    __slots__ = ("ops",)

    def __init__(self) -> None:
        self.ops: list[tuple[Any, ...]] = []

    def put(self, key: bytes, value: bytes) -> None:
        self.ops.append((0, key, value))

    def delete(self, key: bytes) -> None:
        self.ops.append((1, key))

    def delete_range(self, lower: bytes, upper: bytes) -> None:
        self.ops.append((2, lower, upper))

    def is_empty(self) -> bool:
        return not self.ops


class BufferedStore:
    """The DB as the views see it while a per-key run buffers its writes (see the module docstring)."""

    def __init__(self, db: rocksdict.Rdict, flush_bytes: int = 32 << 20) -> None:
        self.db = db
        self.flush_bytes = flush_bytes
        self.batch = rocksdict.WriteBatch(raw_mode=True)
        self.overlay: dict[bytes, bytes | None] = {}     # the current key's writes (None: deleted)
        self.ranges: list[tuple[bytes, bytes]] = []      # the current key's range deletions
        self.flushes = 0

    # --- reads ------------------------------------------------------------------------------------
    def _covered(self, key: bytes) -> bool:
        return any(lo <= key < hi for lo, hi in self.ranges)

    def _get(self, key: bytes) -> bytes | None:
        if key in self.overlay:
            return self.overlay[key]
        if self.ranges and self._covered(key):
            return None
        return self.db.get(key)

    def get(self, key: Any) -> Any:
        if isinstance(key, list):
            if not self.overlay and not self.ranges:
                return self.db.get(key)
            return [self._get(k) for k in key]
        return self._get(key)

    def scan(self, stored: Iterator[tuple[bytes, bytes]], lower: bytes, upper: bytes,
             strip: int) -> Iterator[tuple[bytes, bytes]]:
        """``stored`` (the DB's ``(key, value)`` in ``[lower, upper)``, whole keys) with the overlay applied."""
        mine = sorted((k, v) for k, v in self.overlay.items() if lower <= k < upper)
        ranges = [(lo, hi) for lo, hi in self.ranges if lo < upper and hi > lower]
        if not mine and not ranges:   # nothing of this range is buffered: the DB's own entries
            for k, v in stored:
                yield k[strip:], v
            return
        base: list[tuple[bytes, bytes | None]] = [
            (k, v) for k, v in stored if k not in self.overlay and not (ranges and self._covered(k))]
        # a list's appends sort after its stored elements: then the two follow each other
        follow = not base or not mine or mine[0][0] > base[-1][0]
        merged: Iterator[tuple[bytes, bytes | None]] = (
            itertools.chain(base, mine) if follow else heapq.merge(base, mine, key=lambda kv: kv[0]))
        for key, value in merged:
            if value is not None:
                yield key[strip:], value

    # --- writes -----------------------------------------------------------------------------------
    def put(self, key: bytes, value: bytes) -> None:
        self.batch.put(key, value)
        self.overlay[key] = value

    def delete(self, key: bytes) -> None:
        self.batch.delete(key)
        self.overlay[key] = None

    def delete_range(self, lower: bytes, upper: bytes) -> None:
        self.batch.delete_range(lower, upper)
        for k in [k for k in self.overlay if lower <= k < upper]:
            del self.overlay[k]
        self.ranges.append((lower, upper))

    def write(self, ops: Ops) -> None:
        for op in ops.ops:
            if op[0] == 0:
                self.put(op[1], op[2])
            elif op[0] == 1:
                self.delete(op[1])
            else:
                self.delete_range(op[1], op[2])

    def next_key(self) -> None:
        """A new key begins: earlier keys' writes are not read again in this batch."""
        self.overlay.clear()
        self.ranges.clear()
        if self.batch.size_in_bytes() >= self.flush_bytes:
            self.flush()

    def flush(self) -> None:
        """Write the buffered batch to the DB (as one WAL record)."""
        if not self.batch.is_empty():
            self.db.write(self.batch)
            self.flushes += 1
            self.batch = rocksdict.WriteBatch(raw_mode=True)
