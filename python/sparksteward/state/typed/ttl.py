"""Time to live of declared state (decision 0017): the expiry index, the sweep that removes what
expired through it, and the drop of deleted variables.

**The expiry index.** A value, element or entry of a variable with a TTL carries its expiry in its
header (:data:`~sparksteward.state.rows.TAG_EXPIRING`); a read never returns an expired one (see
:mod:`sparksteward.state.typed.base`). Each such write also puts an index key ``group | 'x' | expiry
(8, big-endian) | the entry's key without its group`` with an empty value (:func:`index_key`), so
:func:`sweep_expired` finds what expired in key order, without a scan of the state. An index key whose
entry was written again later is stale; the sweep deletes it alone.

**Two clocks.** A variable's TTL runs on the batch's processing time (``ttl_time="processing"``) or on
its event-time watermark (``"event"``, decision 0028): its expiry is that clock plus the TTL when it is
written, and it has expired once that clock reaches it. Until a state has a watermark, an event-time
entry is stamped by the processing time (it lives at least its TTL) and nothing of it expires. The
two clocks have two indexes (kinds ``x`` and ``y``), each swept by its own clock.

**Timers go with their key.** A key whose every declared entry the sweep has removed has expired as a
whole: its timers (:mod:`sparksteward.state.timers`) are deleted in the same sweep, so a key that TTL
forgot fires nothing later. The sweep runs after the batch's due timers fired, so a timer due in the
batch fires first; a key with a variable without TTL, or an entry not yet swept, keeps its timers.

**Dropped variables.** :func:`drop_variables` deletes a dropped variable's entries
(``delete_states``) and its expiry-index keys.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import rocksdict

from sparksteward.state.encoding import KIND_LIST, KIND_MAP, KIND_VALUE, key_prefix, split_key
from sparksteward.state.rows import expired, expiry_of
from sparksteward.state.timers import drop_key, has_timers
from sparksteward.state.views import StateDB, _prefix_upper, state_middle

__all__ = ["EXPIRY_KINDS", "KIND_EXPIRY", "KIND_EXPIRY_EVENT", "SweepStats", "drop_variables", "index_expiry",
           "index_key", "restore_clock", "sweep_both", "sweep_expired"]

KIND_EXPIRY = b"x"          # the index of processing-time expiries
KIND_EXPIRY_EVENT = b"y"    # the index of event-time expiries
EXPIRY_KINDS = (KIND_EXPIRY, KIND_EXPIRY_EVENT)
_EXPIRY_LEN = 8


def index_key(entry: bytes, expiry: int, kind: bytes = KIND_EXPIRY) -> bytes:
    """The expiry-index key of entry key ``entry`` expiring at ``expiry`` ms (same key group) in the
    index ``kind`` (the clock of its variable)."""
    return b"".join((entry[:2], kind, expiry.to_bytes(_EXPIRY_LEN, "big"), entry[2:]))


def restore_clock(now_ms: int | None, watermark_ms: int | None, record: Any) -> int | None:
    """The time below which a restore may leave out what expired: the processing time, or, when a
    variable of the declarations ``record`` expires by event time, the smaller of it and the watermark
    (None: there is none yet, so nothing is left out)."""
    variables = (record or {}).get("variables") or {}
    if not any(isinstance(v, dict) and v.get("ttl_time") == "event" and v.get("ttl_ms") for v in variables.values()):
        return now_ms
    return None if now_ms is None or watermark_ms is None else min(now_ms, watermark_ms)


def index_expiry(key: bytes) -> int:
    """The expiry an expiry-index key records."""
    return int.from_bytes(key[3:3 + _EXPIRY_LEN], "big")


@dataclass(frozen=True)
class SweepStats:
    """What one :func:`sweep_expired` did."""

    deleted: int        # expired entries removed
    stale: int          # index keys whose entry had been written again (or removed) since
    more: bool          # the budget ran out before everything expired was swept
    ms: float
    timers_dropped: int = 0   # timers of keys whose every entry expired (they go with their key)


def sweep_expired(backend: StateDB, now_ms: int, *, start: int = 0, max_entries: int = 100_000,
                  max_ms: float = 200.0, kind: bytes = KIND_EXPIRY,
                  gone: set[tuple[bytes, bytes]] | None = None) -> SweepStats:
    """Remove what expired at or before ``now_ms`` in the backend's key groups, through the expiry
    index ``kind`` (whose clock ``now_ms`` is), within ``max_entries`` index keys and about ``max_ms``.
    Key groups are visited from the ``start``-th on (rotate it per batch so that a spent budget does
    not always favour the first). ``gone`` collects ``(group, raw key)`` of the keys an entry was
    removed of."""
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
        lower = gb + kind
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
                    if gone is not None:
                        gone.add((gb, split_key(entry)[3]))
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


def sweep_both(states: Any, start: int, max_entries: int = 100_000) -> SweepStats | None:
    """The sweep of a batch (:func:`sweep_expired` on each clock the declared variables of ``states``,
    a :class:`~sparksteward.state.typed.states.TypedStates`, expire by; the event-time index only once
    there is a watermark), as one :class:`SweepStats`; None when no variable has a TTL."""
    specs = [v.spec for v in states.variables.values() if v.spec.ttl_ms is not None]
    if not specs:
        return None
    runs = []
    gone: set[tuple[bytes, bytes]] = set()
    if any(s.ttl_time != "event" for s in specs):
        runs.append(sweep_expired(states.backend, states.now_ms, start=start, max_entries=max_entries, gone=gone))
    if any(s.ttl_time == "event" for s in specs) and states.watermark_ms is not None:
        runs.append(sweep_expired(states.backend, states.watermark_ms, start=start, max_entries=max_entries,
                                  kind=KIND_EXPIRY_EVENT, gone=gone))
    dropped = _drop_timers_of_expired(states, gone)
    return SweepStats(sum(r.deleted for r in runs), sum(r.stale for r in runs), any(r.more for r in runs),
                      sum(r.ms for r in runs), dropped)


_KIND_OF = {"value": KIND_VALUE, "list": KIND_LIST, "map": KIND_MAP}


def _drop_timers_of_expired(states: Any, gone: set[tuple[bytes, bytes]]) -> int:
    """Delete the timers of the keys in ``gone`` that have no declared entry left (one seek for a key
    without timers, one more per variable for a key with some)."""
    backend = states.backend
    kinds = [(_KIND_OF[v.spec.kind], v.spec.name) for v in states.variables.values()]
    wb = rocksdict.WriteBatch(raw_mode=True)
    dropped = 0
    for group, raw in sorted(gone):
        if not has_timers(backend, group, raw):
            continue
        g = int.from_bytes(group, "big")
        if any(True for kind, name in kinds for prefix in [key_prefix(g, kind, name, raw)]
               for _ in backend.scan(prefix, _prefix_upper(prefix), 0)):
            continue
        dropped += drop_key(backend, wb, group, raw)
    if not wb.is_empty():
        backend.db.write(wb)
    return dropped


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
        for lower in (gb + KIND_EXPIRY, gb + KIND_EXPIRY_EVENT):
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
