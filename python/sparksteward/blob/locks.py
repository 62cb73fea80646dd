"""Per-key locks whose map shrinks: an entry lives only while some thread holds or waits for it.

``with locks[key]:`` serializes work on one key; ``locks.try_hold(key)`` is the non-blocking form
(a context manager yielding whether it got the lock). With ``collections.defaultdict(Lock)`` the map
grew by one lock per key ever seen; here the entry is dropped when its last holder or waiter leaves,
so ``len(locks)`` is the number of keys in use.

Thread-safe. The locks are not reentrant.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable, Iterator

__all__ = ["KeyedLocks"]


class KeyedLocks:
    """A map of per-key locks that removes a key's lock when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._entries: dict[Hashable, list] = {}  # key -> [lock, holders + waiters]

    def __len__(self) -> int:
        with self._guard:
            return len(self._entries)

    def _enter(self, key: Hashable) -> threading.Lock:
        with self._guard:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = [threading.Lock(), 0]
            entry[1] += 1
            return entry[0]

    def _leave(self, key: Hashable) -> None:
        with self._guard:
            entry = self._entries[key]
            entry[1] -= 1
            if entry[1] == 0:
                del self._entries[key]

    def hold(self, key: Hashable) -> _Held:
        return _Held(self, key)

    __getitem__ = hold

    @contextlib.contextmanager
    def try_hold(self, key: Hashable) -> Iterator[bool]:
        """Hold ``key``'s lock if it is free right now; yields whether it was acquired."""
        lock = self._enter(key)
        got = lock.acquire(blocking=False)
        try:
            yield got
        finally:
            if got:
                lock.release()
            self._leave(key)


class _Held:
    """``with locks[key]:`` (a class, not a generator: it is on every blob request's path)."""

    __slots__ = ("_locks", "_key", "_lock")

    def __init__(self, locks: KeyedLocks, key: Hashable) -> None:
        self._locks, self._key = locks, key

    def __enter__(self) -> None:
        self._lock = self._locks._enter(self._key)
        try:
            self._lock.acquire()
        except BaseException:
            self._locks._leave(self._key)
            raise

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        self._locks._leave(self._key)
