"""Time without input (issue 38 slice 3, decision 0028): fire a keyed state's due timers while its
streaming query runs no batch.

Spark runs no micro-batch while the source is idle, so a processing-time timer would wait for the next
row. ``ks.process(..., on_timer=..., idle_timers=60)`` starts an :class:`IdleTimers` watcher in the
driver: once the query ran no batch of the state for ``idle_timers`` seconds and the earliest
processing-time timer the last checkpoint left (``next_timer_ms``, reported by its tasks) is due, or
its earliest event-time timer (``next_event_timer_ms``) is at or below the watermark the next batch
will have (the last batch's largest event time minus the delay: as Spark's no-data batch after the
input stops, the watermark the last rows moved fires what it passes), it runs ``ks.drain(timers=True)``: an empty aligned batch under the next checkpoint id, through the same
function, timer callback and sink, whose tasks fire what is due. The id is recorded in the state's
drain record before the batch begins, so later streaming batches skip it, and the batch is exactly
once like any other (it waits for a running batch of the state, and a streaming batch for it).

**The bound**: on an idle query a timer fires at most ``idle_timers`` seconds plus one poll (a quarter
of that, at most a second) plus one empty batch after the later of its due time and the end of the
query's last batch; a batch of the query fires it sooner. **The cost**: one empty batch each ``idle_timers`` seconds, only while timers are due. The
watcher ends when its query stops (or was never seen to start within an hour) or the state object
goes; it never runs a batch before the query ran one.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

__all__ = ["IdleTimers"]

log = logging.getLogger("sparksteward.keyed_idle")

_NEVER_STARTED = 3600.0   # a watcher whose query never ran a batch ends after this long


class IdleTimers:
    """The watcher of one :meth:`~sparksteward.keyed_state.KeyedState.process` function (see the module
    docstring); :meth:`batch_ran` is called by each of its batches."""

    def __init__(self, ks: Any, idle: float) -> None:
        self.idle = float(idle)
        self.poll = min(self.idle / 4, 1.0)
        self.fired = 0            # the empty batches it ran
        self.query: str | None = None
        self._ks = weakref.ref(ks)
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"steward-idle-timers-{ks.name}", daemon=True)
        self._thread.start()

    def batch_ran(self, query: str | None) -> None:
        self._last = time.monotonic()
        self.query = query or self.query

    def stop(self) -> None:
        self._stop.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _query_active(self, ks: Any) -> bool | None:
        """Whether the query runs (None: no batch of it seen yet)."""
        if self.query is None:
            return None
        try:
            q = ks._st.spark.streams.get(self.query)
        except Exception:  # noqa: BLE001 - a stopped session: the query is gone
            return False
        return q is not None and bool(q.isActive)

    def _due(self, ks: Any) -> bool:
        report = ks.report()
        if not report:
            return False
        nxt = report.get("next_timer_ms")
        if nxt is not None and nxt <= time.time() * 1000:
            return True
        # an event-time timer the next watermark passes: the last batch's largest event time moved it
        # (Spark's no-data batch after the input stops does the same)
        nxt, top, event = report.get("next_event_timer_ms"), report.get("max_event_ms"), ks.event_time
        if nxt is None or top is None or event is None:
            return False
        upcoming = top - event.delay_ms
        if report.get("watermark_ms") is not None:   # the watermark never goes back
            upcoming = max(upcoming, report["watermark_ms"])
        return nxt <= upcoming

    def _run(self) -> None:
        started = time.monotonic()
        while not self._stop.wait(self.poll):
            ks = self._ks()
            if ks is None:
                return
            active = self._query_active(ks)
            if active is False or (active is None and time.monotonic() - started > _NEVER_STARTED):
                return
            if active is None or time.monotonic() - self._last < self.idle or not self._due(ks):
                continue
            try:
                ks.drain(timers=True)
                self.fired += 1
            except Exception as exc:  # noqa: BLE001 - the stream's next batch fires them; say why not now
                log.warning("keyed state %s: firing its due timers on the idle stream failed (%s); the next batch "
                            "fires them", ks.name, exc)
            self._last = time.monotonic()
