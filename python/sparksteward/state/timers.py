"""Timers of a keyed state (issue 38 slice 2, decision 0028): per key, processing-time and event-time
timers the function registers, deletes and lists, stored as RocksDB entries of the subtask's DB.

**Layout.** A timer is two empty-valued entries in its key's key group, written and deleted together:

- by time, ``group | 't' | domain | at | key``: a subtask finds its due timers with one range scan per
  key group and domain, from the start to the batch's processing time or watermark, never a scan of
  the keys (:func:`due`);
- by key, ``group | 'u' | len(key) | key | domain | at``: ``list`` and the deletion of a key's timers.

``domain`` is ``p`` (processing time) or ``e`` (event time); ``at`` is epoch milliseconds, 8 bytes
big-endian offset by 2**63 so that key order is time order. Being ordinary entries of the key group,
timers are checkpointed incrementally with the DB, merged (FLIP-306), moved with their key group on a
rescale and restored by every attempt from its base, like the values. Firing them is
:mod:`sparksteward.state.firing`.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from sparksteward.errors import StateError
from sparksteward.state.views import StateDB, _prefix_upper

__all__ = ["KIND_TIMER_BY_KEY", "KIND_TIMER_BY_TIME", "TIMER_KINDS", "TIMES", "BoundTimers", "Timer", "Timers",
           "parse_by_time",
           "Due", "drop_key", "due", "due_columns", "forget", "forget_all", "forget_at", "has_timers", "next_processing", "timer_at"]

KIND_TIMER_BY_TIME = b"t"
KIND_TIMER_BY_KEY = b"u"
TIMER_KINDS = (KIND_TIMER_BY_TIME, KIND_TIMER_BY_KEY)
TIMES = ("processing", "event")
_DOMAIN = {"processing": b"p", "event": b"e"}
_TIME_OF = {v: k for k, v in _DOMAIN.items()}
_OFFSET = 1 << 63
_LIMIT = 1 << 62   # |at| in ms: far beyond any date


class Timer(NamedTuple):
    """A registered timer: ``time`` (``"processing"`` or ``"event"``) and ``at`` (epoch ms)."""

    time: str
    at: int


def timer_at(at: Any, what: str = "at") -> int:
    """``at`` as epoch ms: an int, a ``datetime`` (naive: UTC) or a pandas/numpy timestamp."""
    if isinstance(at, dt.datetime):
        return round((at if at.tzinfo else at.replace(tzinfo=dt.timezone.utc)).timestamp() * 1000)
    if hasattr(at, "to_pydatetime"):   # pandas.Timestamp
        return timer_at(at.to_pydatetime(), what)
    if hasattr(at, "dtype") and str(getattr(at, "dtype", "")).startswith("datetime64"):
        return int(at.astype("datetime64[ms]").astype("int64"))
    if isinstance(at, bool) or not hasattr(at, "__index__"):
        raise StateError(f"timer {what}={at!r} must be epoch milliseconds (an int) or a datetime")
    ms = int(at)
    if not -_LIMIT < ms < _LIMIT:
        raise StateError(f"timer {what}={at!r} is out of range for epoch milliseconds")
    return ms


def _domain(time: str) -> bytes:
    try:
        return _DOMAIN[time]
    except (KeyError, TypeError):
        raise StateError(f"timer time={time!r} must be 'processing' (the batch's processing time) or 'event' "
                         f"(the watermark)") from None


def _by_time(group: bytes, domain: bytes, at: int, raw: bytes) -> bytes:
    return b"".join((group, KIND_TIMER_BY_TIME, domain, (at + _OFFSET).to_bytes(8, "big"), raw))


def _by_key_prefix(group: bytes, raw: bytes) -> bytes:
    return b"".join((group, KIND_TIMER_BY_KEY, len(raw).to_bytes(2, "big"), raw))


class Timers:
    """The timers of a subtask's keys (the Arrow form's ``state.timers``; :meth:`bind` gives one key's).

    ``event_time``: the state has an event-time column, so event-time timers can ever fire."""

    def __init__(self, backend: StateDB, event_time: bool = False) -> None:
        self.backend = backend
        self.event_time = event_time

    def bind(self, key: object) -> BoundTimers:
        return BoundTimers(self, key)

    def _check(self, time: str) -> bytes:
        domain = _domain(time)
        if time == "event" and not self.event_time:
            raise StateError("an event-time timer fires when the watermark passes it, and this keyed state has "
                             "none: open it with event_time=<column> (and watermark_delay=...), or use "
                             "time='processing'")
        return domain

    def _keys(self, key: object) -> tuple[bytes, bytes]:
        group, raw = self.backend.owned_key(key)
        return group.to_bytes(2, "big"), raw

    def register(self, keys: Iterable[object], at: Any, time: str = "processing") -> None:
        """A timer at ``at`` (epoch ms or a datetime; one for all keys or one per key) for each of ``keys``;
        registering one that exists changes nothing."""
        self._write(keys, at, time, delete=False)

    def delete(self, keys: Iterable[object], at: Any, time: str = "processing") -> None:
        """Delete the timer at ``at`` of each of ``keys`` (one that does not exist is ignored)."""
        self._write(keys, at, time, delete=True)

    def _write(self, keys: Iterable[object], at: Any, time: str, *, delete: bool) -> None:
        domain = self._check(time)
        ks = keys.to_pylist() if isinstance(keys, (pa.Array, pa.ChunkedArray)) else list(keys)
        if isinstance(at, (pa.Array, pa.ChunkedArray)):
            ats = [timer_at(a) for a in at.to_pylist()]
        elif isinstance(at, (list, tuple)) or getattr(at, "ndim", 0) == 1:   # numpy arrays, pandas Series
            ats = [timer_at(a) for a in at]
        else:
            ats = [timer_at(at)] * len(ks)
        if len(ats) != len(ks):
            raise StateError(f"timers: {len(ks)} keys but {len(ats)} times; give one time for all or one per key")
        wb = self.backend.new_batch()
        for key, ms in zip(ks, ats):
            group, raw = self._keys(key)
            by_key = _by_key_prefix(group, raw) + domain + (ms + _OFFSET).to_bytes(8, "big")
            if delete:
                wb.delete(_by_time(group, domain, ms, raw))
                wb.delete(by_key)
            else:
                wb.put(_by_time(group, domain, ms, raw), b"")
                wb.put(by_key, b"")
        self.backend.store.write(wb)

    def _list_one(self, key: object) -> list[Timer]:
        group, raw = self._keys(key)
        prefix = _by_key_prefix(group, raw)
        out = [Timer(_TIME_OF[rest[:1]], int.from_bytes(rest[1:9], "big") - _OFFSET)
               for rest, _ in self.backend.scan(prefix, _prefix_upper(prefix), len(prefix))]
        return sorted(out, key=lambda t: (t.at, t.time))

    def list(self, keys: Iterable[object]) -> pa.Table:
        """The timers of ``keys``: a table of ``key``, ``time`` and ``at`` (epoch ms), by key then time."""
        ks = keys.to_pylist() if isinstance(keys, (pa.Array, pa.ChunkedArray)) else list(keys)
        rows = [(k, t.time, t.at) for k in ks for t in self._list_one(k)]
        return pa.table({"key": [r[0] for r in rows], "time": pa.array([r[1] for r in rows], pa.string()),
                         "at": pa.array([r[2] for r in rows], pa.int64())})


class BoundTimers:
    """One key's timers (the per-key form's ``state.timers``)."""

    __slots__ = ("_key", "_timers")

    def __init__(self, timers: Timers, key: object) -> None:
        self._timers = timers
        self._key = key

    def register(self, at: Any, time: str = "processing") -> None:
        """A timer at ``at`` (epoch ms or a datetime) in ``time`` ``"processing"`` or ``"event"``: it
        fires in the first batch whose processing time (or watermark) is at or past it."""
        self._timers.register([self._key], [at], time)

    def delete(self, at: Any, time: str = "processing") -> None:
        self._timers.delete([self._key], [at], time)

    def list(self) -> list[Timer]:
        """This key's timers, earliest first."""
        return self._timers._list_one(self._key)


def parse_by_time(stored_key: bytes) -> tuple[bytes, Timer]:
    """The raw user key and the timer of a by-time entry's stored key (kind ``t``): what an offline
    reader lists (:mod:`sparksteward.checkpoint.reader`)."""
    domain, stamp, raw = stored_key[3:4], stored_key[4:12], stored_key[12:]
    return raw, Timer(_TIME_OF[domain], int.from_bytes(stamp, "big") - _OFFSET)


def due(backend: Any, processing_ms: int, watermark_ms: int | None) -> Iterator[tuple[bytes, bytes, Timer]]:
    """The subtask's timers due at the batch's ``processing_ms`` and ``watermark_ms`` (an event-time
    timer is due once the watermark is at or past it): ``(group, raw key, timer)`` in key-group, then
    domain, then time order (:func:`due_columns`, one timer at a time)."""
    d = due_columns(backend, processing_ms, watermark_ms)
    for group, raw, domain, at in zip(d.groups, d.raws, d.domains, d.ats.tolist()):
        yield group, raw, Timer(_TIME_OF[domain], at)


class Due(NamedTuple):
    """The due timers of a subtask as columns (:func:`due_columns`): per timer its key group (2 bytes),
    raw key, domain byte, stored time (8 bytes) and time (epoch ms); and the by-time ranges they fill
    (each range holds exactly them)."""

    groups: list[bytes]
    raws: list[bytes]
    domains: list[bytes]
    stamps: list[bytes]
    ats: np.ndarray
    ranges: list[tuple[bytes, bytes]]


def due_columns(backend: Any, processing_ms: int, watermark_ms: int | None) -> Due:
    """:func:`due` in columns, for the vectorized firing: one ``keys_between`` per key group and domain,
    the times decoded at once (the backend must not be in a buffered run)."""
    groups: list[bytes] = []
    raws: list[bytes] = []
    domains: list[bytes] = []
    stamps: list[bytes] = []
    ranges: list[tuple[bytes, bytes]] = []
    for g in range(backend.key_groups.start, backend.key_groups.stop):
        gb = g.to_bytes(2, "big")
        for domain, upto in ((_DOMAIN["processing"], processing_ms), (_DOMAIN["event"], watermark_ms)):
            if upto is None:
                continue
            lower = gb + KIND_TIMER_BY_TIME + domain
            upper = lower + (upto + 1 + _OFFSET).to_bytes(8, "big")
            keys = backend.keys_between(lower, upper)   # one range scan per key group and domain
            if not keys:
                continue
            ranges.append((lower, upper))
            n = len(lower)
            stamps.extend(k[n:n + 8] for k in keys)
            raws.extend(k[n + 8:] for k in keys)
            groups.extend([gb] * len(keys))
            domains.extend([domain] * len(keys))
    ats = (np.frombuffer(b"".join(stamps), dtype=">u8").astype(np.uint64) ^ np.uint64(_OFFSET)).view(np.int64)
    return Due(groups, raws, domains, stamps, ats, ranges)


def forget_at(wb: Any, fired: Due, i: int) -> None:
    """Delete timer ``i`` of ``fired`` (both of its entries) in ``wb``."""
    forget(wb, fired.groups[i], fired.raws[i], Timer(_TIME_OF[fired.domains[i]], int(fired.ats[i])))


def forget_all(wb: Any, fired: Due) -> None:
    """Delete every timer of ``fired`` (all that its ranges hold) in ``wb``: a range delete per by-time
    range, a delete per by-key entry."""
    for lower, upper in fired.ranges:
        wb.delete_range(lower, upper)
    for group, raw, domain, stamp in zip(fired.groups, fired.raws, fired.domains, fired.stamps):
        wb.delete(b"".join((group, KIND_TIMER_BY_KEY, len(raw).to_bytes(2, "big"), raw, domain, stamp)))


def next_processing(backend: StateDB, time: str = "processing") -> int | None:
    """The earliest timer of the subtask in domain ``time`` (None: none): one seek per key group."""
    first = None
    for g in range(backend.key_groups.start, backend.key_groups.stop):
        lower = g.to_bytes(2, "big") + KIND_TIMER_BY_TIME + _DOMAIN[time]
        for rest, _ in backend.scan(lower, _prefix_upper(lower), len(lower)):
            at = int.from_bytes(rest[:8], "big") - _OFFSET
            first = at if first is None else min(first, at)
            break
    return first


def forget(wb: Any, group: bytes, raw: bytes, timer: Timer) -> None:
    """Delete a fired timer (both of its entries) in the write batch ``wb`` (``backend.new_batch()``)."""
    domain = _DOMAIN[timer.time]
    wb.delete(_by_time(group, domain, timer.at, raw))
    wb.delete(_by_key_prefix(group, raw) + domain + (timer.at + _OFFSET).to_bytes(8, "big"))


def has_timers(backend: StateDB, group: bytes, raw: bytes) -> bool:
    """Whether the key ``raw`` of key group ``group`` has a timer (one seek)."""
    prefix = _by_key_prefix(group, raw)
    return any(True for _ in backend.scan(prefix, _prefix_upper(prefix), len(prefix)))


def drop_key(backend: StateDB, wb: Any, group: bytes, raw: bytes) -> int:
    """Delete every timer of one key (both entries of each) in ``wb``: its state expired (TTL, decision
    0028). Returns how many."""
    prefix = _by_key_prefix(group, raw)
    n = 0
    for rest, _ in backend.scan(prefix, _prefix_upper(prefix), len(prefix)):
        forget(wb, group, raw, Timer(_TIME_OF[rest[:1]], int.from_bytes(rest[1:9], "big") - _OFFSET))
        n += 1
    return n
