"""Per-key locks whose map shrinks (:class:`KeyedLocks`), and a gate per job (:class:`JobGate`).

``with locks[key]:`` serializes work on one key; ``locks.try_hold(key)`` is the non-blocking form
(a context manager yielding whether it got the lock). With ``collections.defaultdict(Lock)`` the map
grew by one lock per key ever seen; here the entry is dropped when its last holder or waiter leaves,
so ``len(locks)`` is the number of keys in use.

A :class:`JobGate` orders the work on a job's blobs (puts, refills) against a delete of the whole job:
work of a job runs side by side, a delete of the job runs alone. A delete that is waiting keeps new
work of its job out (deletes are rare and must not starve), and work that was inside when the delete
arrived can see it before it leaves (:meth:`JobGate.try_leave`). Its map, too, holds only the jobs in
use.

Thread-safe. The locks are not reentrant.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Iterator

__all__ = ["JobGate", "KeyedLocks"]


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


class JobGate:
    """Work on a job runs side by side; a delete of the job runs alone (see the module docstring).

    ``enter(job)`` waits while a delete of ``job`` waits or runs, then counts the caller in;
    ``leave(job)`` counts it out; ``try_leave(job)`` counts it out only if no delete of ``job`` arrived
    meanwhile (False: the caller is still in, and may save what the delete will remove before it
    leaves). ``with gate.alone(job):`` waits until the work inside has left and no other delete of
    ``job`` runs. ``on_wait("enter")`` / ``on_wait("alone")`` is called before each wait (a counter).

    One guard lock, held for a dict update; an uncontended ``enter`` and ``try_leave`` take it once each.
    """

    def __init__(self, on_wait: Callable[[str], None] | None = None) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._inside: dict[Hashable, int] = {}   # job -> work inside
        self._deletes: dict[Hashable, int] = {}  # job -> deletes waiting or running
        self._alone: set[Hashable] = set()       # jobs whose delete runs
        self._on_wait = on_wait or (lambda what: None)

    def __len__(self) -> int:
        """The number of jobs in use (with work inside, or a delete waiting or running)."""
        with self._cond:
            return len(self._inside.keys() | self._deletes.keys())

    def enter(self, job: Hashable) -> None:
        with self._cond:
            if job in self._deletes:
                self._on_wait("enter")
                while job in self._deletes:
                    self._cond.wait()
            self._inside[job] = self._inside.get(job, 0) + 1

    def leave(self, job: Hashable) -> None:
        with self._cond:
            self._leave(job)

    def try_leave(self, job: Hashable) -> bool:
        with self._cond:
            if job in self._deletes:
                return False
            self._leave(job)
            return True

    def _leave(self, job: Hashable) -> None:
        n = self._inside[job] - 1
        if n:
            self._inside[job] = n
            return
        del self._inside[job]
        if job in self._deletes:
            self._cond.notify_all()

    @contextlib.contextmanager
    def alone(self, job: Hashable) -> Iterator[None]:
        with self._cond:
            self._deletes[job] = self._deletes.get(job, 0) + 1
            try:
                if job in self._inside or job in self._alone:
                    self._on_wait("alone")
                    while job in self._inside or job in self._alone:
                        self._cond.wait()
            except BaseException:
                self._done(job)
                raise
            self._alone.add(job)
        try:
            yield
        finally:
            with self._cond:
                self._alone.discard(job)
                self._done(job)

    def _done(self, job: Hashable) -> None:
        n = self._deletes[job] - 1
        if n:
            self._deletes[job] = n
        else:
            del self._deletes[job]
        self._cond.notify_all()
