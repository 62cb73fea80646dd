"""Event-time windows and sessions, built on keyed state and timers (issue 38, decision 0028).

Not an engine of its own: each helper is a per-key function, a timer callback and the state they keep,
written as you would write them, so read this module as an example of the API::

    from sparksteward.windows import sessions

    s = sessions(key="user", time="ts", gap=timedelta(minutes=30))
    ks = st.keyed_state("sessions", key="user", parallelism=4, event_time="ts",
                        watermark_delay=timedelta(minutes=10), states=s.states)
    events.writeStream.foreachBatch(ks.process(s.fn, s.schema, sink, on_timer=s.on_timer)).start()

Each emits ``key, window_start, window_end, events`` once the watermark passes the window's end (plus
``allowed_lateness``), as Spark's ``session_window`` and ``window`` group a batch query: a session
starts at its first event and ends ``gap`` after its last; a window of ``size`` starts every ``slide``.
Rows at or below the watermark are late: the state drops them before these functions see them.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

import pandas as pd

from sparksteward.errors import StateError
from sparksteward.state.declared import StateSpec, duration_ms, map_state

__all__ = ["Windowing", "sessions", "windows"]


@dataclass(frozen=True)
class Windowing:
    """What ``process`` takes: ``fn``, ``on_timer``, the output ``schema`` and the ``states`` to declare."""

    fn: Any
    on_timer: Any
    schema: str
    states: list[StateSpec]


def _ms(value: dt.timedelta | float, what: str, *, positive: bool = True) -> int:
    ms = duration_ms(value, what)
    if ms < (1 if positive else 0):
        raise StateError(f"{what}={value!r} must be {'positive' if positive else 'at least 0'}")
    return ms


def _event_ms(rows: pd.DataFrame, time: str) -> list[int]:
    col = rows[time]
    if pd.api.types.is_datetime64_any_dtype(col):
        return sorted((col.astype("datetime64[ms, UTC]" if col.dt.tz else "datetime64[ms]")
                       .astype("int64")).tolist())
    return sorted(int(v) for v in col)


def _out(column: str, key: Any, windows: list[tuple[int, int, int]]) -> pd.DataFrame:
    return pd.DataFrame({column: [key] * len(windows),
                         "window_start": pd.to_datetime([w[0] for w in windows], unit="ms", utc=True),
                         "window_end": pd.to_datetime([w[1] for w in windows], unit="ms", utc=True),
                         "events": [w[2] for w in windows]})


def _schema(key: str, key_type: str) -> str:
    return f"`{key}` {key_type}, window_start timestamp, window_end timestamp, events bigint"


def sessions(*, key: str, time: str, gap: dt.timedelta | float, allowed_lateness: dt.timedelta | float = 0,
             key_type: str = "string") -> Windowing:
    """Session windows: a key's events less than ``gap`` apart are one session (``gap``: seconds or a
    timedelta). Open sessions live in a map state (start -> last event, events) with one event-time
    timer each, at the session's end plus ``allowed_lateness``."""
    gap_ms, late_ms = _ms(gap, "gap"), _ms(allowed_lateness, "allowed_lateness", positive=False)

    def fn(k: Any, rows: pd.DataFrame, state: Any) -> None:
        open_ = state.map("sessions")
        spans = [(s, v["last"], v["events"]) for s, v in open_.items()]
        for _, last, _n in spans:   # the timers of what this batch may merge; set again below
            state.timers.delete(last + gap_ms + late_ms, time="event")
        for t in _event_ms(rows, time):
            merged = (t, t, 1)
            keep = []
            for s, last, n in spans:   # every session within the gap of the event joins it
                if s - gap_ms < t < last + gap_ms:
                    merged = (min(s, merged[0]), max(last, merged[1]), merged[2] + n)
                else:
                    keep.append((s, last, n))
            spans = [*keep, merged]
        open_.clear()
        for s, last, n in spans:
            open_.put(s, {"last": last, "events": n})
            state.timers.register(last + gap_ms + late_ms, time="event")

    def on_timer(k: Any, timers: list[Any], state: Any) -> pd.DataFrame:
        open_ = state.map("sessions")
        done = [(s, v["last"] + gap_ms, v["events"]) for s, v in open_.items()
                if v["last"] + gap_ms + late_ms <= state.watermark_ms]
        for s, _, _ in done:
            open_.remove(s)
        return _out(key, k, done)

    return Windowing(fn, on_timer, _schema(key, key_type),
                     [map_state("sessions", "bigint", "last bigint, events bigint")])


def windows(*, key: str, time: str, size: dt.timedelta | float, slide: dt.timedelta | float | None = None,
            allowed_lateness: dt.timedelta | float = 0, key_type: str = "string") -> Windowing:
    """Tumbling (``slide`` None) or sliding windows of ``size`` starting every ``slide`` (aligned to the
    epoch, as Spark's ``window``): a map state of window start -> events, and one event-time timer per
    open window at its end plus ``allowed_lateness``."""
    size_ms, late_ms = _ms(size, "size"), _ms(allowed_lateness, "allowed_lateness", positive=False)
    slide_ms = size_ms if slide is None else _ms(slide, "slide")

    def fn(k: Any, rows: pd.DataFrame, state: Any) -> None:
        counts = state.map("windows")
        added: dict[int, int] = {}
        for t in _event_ms(rows, time):
            start = t - t % slide_ms
            while start > t - size_ms:   # every window that holds t
                added[start] = added.get(start, 0) + 1
                start -= slide_ms
        for start, n in added.items():
            before = counts.get(start)
            counts.put(start, (before or 0) + n)
            if before is None:
                state.timers.register(start + size_ms + late_ms, time="event")

    def on_timer(k: Any, timers: list[Any], state: Any) -> pd.DataFrame:
        counts = state.map("windows")
        done = [(t.at - size_ms - late_ms, t.at - late_ms, counts.get(t.at - size_ms - late_ms) or 0) for t in timers]
        for start, _, _ in done:
            counts.remove(start)
        return _out(key, k, [w for w in done if w[2]])

    return Windowing(fn, on_timer, _schema(key, key_type), [map_state("windows", "bigint", "bigint")])
